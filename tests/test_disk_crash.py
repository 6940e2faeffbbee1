"""The disk tier survives kill -9 at any moment and damaged files: whatever it serves afterwards is
byte-exact, everything else is a miss, and the store stays usable.

Payloads are derived from the key, so the checking process can tell good bytes from bad ones. Reads
of a damaged store run in child processes: LMDB can kill a process on a damaged page, and the test
must tell such a crash from a clean result.
"""
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from kvstrata.tiers.base import BlockLayout
from kvstrata.tiers.disk import DiskTier

LAYOUT_SOURCE = "BlockLayout(num_layers=4, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)"
LAYOUT = eval(LAYOUT_SOURCE)
MiB = 1 << 20

# Shared by this module and its child processes: the payload of block i is a function of i.
BLOCKS_SOURCE = f"""
import numpy as np
import torch
from kvstrata.tiers.base import BlockLayout
L = {LAYOUT_SOURCE}
def payload(i):
    return torch.from_numpy(np.random.default_rng(i).integers(0, 256, L.block_nbytes, dtype=np.uint8))
def key(i): return i.to_bytes(16, "big")
def tokens(i): return [i * 16 + t for t in range(16)]
"""
exec(BLOCKS_SOURCE)

# Streams puts until killed; after every flush, prints the number of blocks known to be committed.
WRITER = BLOCKS_SOURCE + """
import sys
from kvstrata.tiers.disk import DiskTier
tier = DiskTier(L, sys.argv[1], int(sys.argv[2]), writer_batch=8)
i = int(sys.argv[3])
while True:
    tier.put([key(j) for j in range(i, i + 8)], [tokens(j) for j in range(i, i + 8)],
             [payload(j) for j in range(i, i + 8)])
    i += 8
    if i % 32 == 0:
        tier.flush()
        print(i, flush=True)
"""

# For each store path: fork, open it, read every block id given, check the store still takes a
# write, report. A fork that dies by a signal is reported as such: that is a crash, not a result.
READER = BLOCKS_SOURCE + """
import json, os, sys
from kvstrata.tiers.disk import DiskTier

def read_back(path, ids, capacity):
    result = {}
    try:
        tier = DiskTier(L, path, capacity)
    except ValueError as e:  # a one-line refusal to open is a clean outcome
        return {"open_error": str(e)}
    dests = [torch.empty(L.block_nbytes, dtype=torch.uint8) for _ in ids]
    served = tier.get([key(i) for i in ids], [tokens(i) for i in ids], dests)
    result["served"] = [i for i, ok in zip(ids, served) if ok]
    result["wrong"] = [i for i, ok, d in zip(ids, served, dests) if ok and not torch.equal(d, payload(i))]
    result["corrupt"] = tier.stats().corrupt
    probe = 10**9
    tier.put([key(probe)], [tokens(probe)], [payload(probe)])
    tier.flush()
    dest = torch.empty(L.block_nbytes, dtype=torch.uint8)
    result["usable"] = tier.get([key(probe)], [tokens(probe)], [dest]) == [True] and torch.equal(dest, payload(probe))
    tier.close()
    return result

paths, ids, capacity = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
results = []
for path in paths:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            out = read_back(path, ids, capacity)
        except BaseException as e:
            out = {"exception": f"{type(e).__name__}: {e}"}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        raw = f.read()
    _, status = os.waitpid(pid, 0)
    results.append({"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else json.loads(raw))
print(json.dumps(results))
"""


def read_back(paths: list[str], ids, capacity: int) -> list[dict]:
    proc = subprocess.run([sys.executable, "-c", READER, json.dumps(paths), json.dumps(list(ids)), str(capacity)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_kill_9_while_writing_leaves_only_whole_verified_blocks_and_a_usable_store(tmp_path):
    path = str(tmp_path / "kvstore")
    capacity = 6 * MiB  # ~190 blocks: the writer is evicting as well as inserting when it dies
    rng = random.Random(1234)
    next_id = 0
    for round_ in range(3):
        child = subprocess.Popen([sys.executable, "-c", WRITER, path, str(capacity), str(next_id)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = child.stdout.readline()
        assert first.strip(), child.stderr.read()  # it has committed something
        time.sleep(rng.uniform(0.0, 1.0))
        os.kill(child.pid, signal.SIGKILL)
        rest, _ = child.communicate()
        committed = int(([first] + rest.split())[-1])
        ids = list(range(next_id, committed + 4 * 64 * 8))  # beyond the last flush: may have committed too
        tier = DiskTier(LAYOUT, path, capacity)
        dests = [torch.empty(LAYOUT.block_nbytes, dtype=torch.uint8) for _ in ids]
        served = tier.get([key(i) for i in ids], [tokens(i) for i in ids], dests)
        assert all(torch.equal(d, payload(i)) for i, ok, d in zip(ids, served, dests) if ok), "served wrong bytes"
        assert tier.stats().corrupt == 0, f"round {round_}: a torn or unverifiable entry after kill -9"
        assert served[ids.index(committed - 1)], f"round {round_}: a block flushed before the kill is gone"
        probe = 10**9 + round_
        tier.put([key(probe)], [tokens(probe)], [payload(probe)])
        tier.flush()
        dest = torch.empty(LAYOUT.block_nbytes, dtype=torch.uint8)
        assert tier.get([key(probe)], [tokens(probe)], [dest]) == [True] and torch.equal(dest, payload(probe))
        assert tier.stats().used_bytes <= capacity
        tier.close()
        next_id = ids[-1] + 1


NUM_BLOCKS = 40


@pytest.fixture(scope="module")
def filled_store(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("filled") / "kvstore")
    tier = DiskTier(LAYOUT, path, 64 * MiB)
    ids = range(NUM_BLOCKS)
    tier.put([key(i) for i in ids], [tokens(i) for i in ids], [payload(i) for i in ids])
    tier.close()
    return path


def damaged_copy(base: str, target: str, offsets_and_bytes) -> str:
    shutil.copytree(base, target)
    with open(os.path.join(target, "data.mdb"), "r+b") as f:
        for offset, make_byte in offsets_and_bytes:
            f.seek(offset)
            old = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([make_byte(old)]))
    return target


def test_damaged_payload_bytes_are_misses_and_the_rest_is_served(filled_store, tmp_path):
    content = open(os.path.join(filled_store, "data.mdb"), "rb").read()
    rng = random.Random(7)
    damaged = sorted(rng.sample(range(NUM_BLOCKS), 8))
    edits = []
    for i in damaged:
        start = content.find(payload(i).numpy()[:64].tobytes())  # locate the payload in the file
        assert start >= 0, f"payload of block {i} not found in the file"
        edits.append((start + rng.randrange(LAYOUT.block_nbytes), lambda old: old ^ (1 << rng.randrange(8))))
    path = damaged_copy(filled_store, str(tmp_path / "damaged"), edits)
    (result,) = read_back([path], range(NUM_BLOCKS), 64 * MiB)
    assert result["wrong"] == []
    assert sorted(set(range(NUM_BLOCKS)) - set(result["served"])) == damaged
    assert result["corrupt"] == len(damaged) and result["usable"]


def test_random_damage_anywhere_in_the_file_never_serves_garbage_or_crashes(filled_store, tmp_path):
    size = os.path.getsize(os.path.join(filled_store, "data.mdb"))
    structure_end = min(size, 16 * 4096)  # a store this small keeps its meta and B-tree pages up front
    paths = []
    for seed in range(8):
        rng = random.Random(seed)
        # Even seeds hit anywhere (mostly payload pages); odd ones the meta and B-tree pages.
        limit = size if seed % 2 == 0 else structure_end
        edits = [(rng.randrange(limit), lambda old, b=rng.randrange(256): b) for _ in range(24)]
        paths.append(damaged_copy(filled_store, str(tmp_path / f"damaged-{seed}"), edits))
    results = read_back(paths, range(NUM_BLOCKS), 64 * MiB)
    for seed, result in enumerate(results):
        assert "signal" not in result, f"seed {seed}: the reading process was killed by signal {result['signal']}"
        assert "exception" not in result, f"seed {seed}: {result['exception']}"
        if "open_error" in result:
            assert result["open_error"].startswith("cache.tiers.disk.path:"), result
            continue
        assert result["wrong"] == [], f"seed {seed}: served wrong bytes for blocks {result['wrong']}"


# Opens a store, fills it, damages it while the tier holds it open, then reads, flushes and writes.
DAMAGE_UNDER_A_RUNNING_TIER = BLOCKS_SOURCE + """
import json, logging, os, struct, sys
from kvstrata.tiers.disk import DiskTier
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
path, damage = sys.argv[1], sys.argv[2]
tier = DiskTier(L, path, 64 << 20)
ids = list(range(40))
tier.put([key(i) for i in ids], [tokens(i) for i in ids], [payload(i) for i in ids])
tier.flush()
data = os.path.join(path, "data.mdb")
if damage == "truncated":
    os.truncate(data, 3 * 4096)
else:  # the leaf pages that hold the keys no longer pass LMDB's page checks
    with open(data, "r+b") as f:
        content = f.read()
        for start in range(0, len(content), 4096):
            page = content[start:start + 4096]
            if struct.unpack_from("<H", page, 10)[0] & 0x02 and key(5) in page:  # P_LEAF
                f.seek(start + 10)
                f.write(b"\\0\\0")
dests = [torch.empty(L.block_nbytes, dtype=torch.uint8) for _ in ids]
result = {"served": sum(tier.get([key(i) for i in ids], [tokens(i) for i in ids], dests)),
          "held": tier.count_prefix([key(i) for i in ids])}
tier.flush()
probe = 10**6
tier.put([key(probe)], [tokens(probe)], [payload(probe)])
tier.flush()
dest = torch.empty(L.block_nbytes, dtype=torch.uint8)
result["fresh_store_serves"] = tier.get([key(probe)], [tokens(probe)], [dest]) == [True] and torch.equal(dest, payload(probe))
result["write_errors"] = tier.stats().extra["write_errors"]
tier.close()
print(json.dumps(result))
"""


@pytest.mark.parametrize("damage", ["truncated", "unreadable-pages"])
def test_a_store_damaged_under_a_running_tier_is_moved_aside_and_replaced_without_a_crash(tmp_path, damage):
    path = str(tmp_path / "kvstore")
    proc = subprocess.run([sys.executable, "-c", DAMAGE_UNDER_A_RUNNING_TIER, path, damage],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"the process died ({proc.returncode}): {proc.stderr[-3000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["served"] == 0 and result["held"] == 0  # reads of a damaged store are misses
    assert result["fresh_store_serves"] and result["write_errors"] == 0
    assert len(glob.glob(os.path.join(path, "data.mdb.corrupt-*"))) == 1
    assert proc.stderr.count("is damaged") == 1, proc.stderr  # logged once
