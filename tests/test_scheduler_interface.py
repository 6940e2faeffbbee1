"""The scheduler talks to the KV cache manager only through the few whole operations its module doc lists
(as vLLM's scheduler does through `get_computed_blocks`, `allocate_slots`, `free`...): it never reaches into the
device pool, the manager's per-request states or a request's hit account. Read from the source, as
tests/test_layout.py reads the imports."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import kvstrata.engine.scheduler as scheduler_module

ENGINE = Path(__file__).resolve().parent.parent / "engine"
SCHEDULING_FILES = (ENGINE / "scheduler.py", ENGINE / "scheduling_policy.py")
# What the scheduler leaves to the KV manager: never read where it schedules, under any receiver.
KV_INTERNALS = {"pool", "states", "hierarchy", "read_costs", "hits", "req_to_blocks", "_abandoned", "prefix_stats"}


def listed_calls() -> set[str]:
    """The KV manager's members that scheduler.py's module doc lists (`- \\`name(...)\\``)."""
    return set(re.findall(r"^- `(\w+)", scheduler_module.__doc__, re.MULTILINE))


def _is_kv_manager(node: ast.AST) -> bool:
    """`self.kv`, `scheduler.kv` (a policy's view of it) or a bare `kv_manager`."""
    return ((isinstance(node, ast.Attribute) and node.attr == "kv")
            or (isinstance(node, ast.Name) and node.id == "kv_manager"))


def kv_manager_use(source: str) -> tuple[set[str], list[str]]:
    """The KV manager's members `source` uses, and what it does that a narrow interface forbids: holding the
    manager under another name (where its uses could not be seen) or reading what the manager keeps inside."""
    used, breaches = set(), []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _is_kv_manager(node.value):
            used.add(node.attr)
        if isinstance(node, ast.Attribute) and node.attr in KV_INTERNALS:
            breaches.append(f"line {node.lineno}: .{node.attr}")
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and _is_kv_manager(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if not all(isinstance(t, ast.Attribute) and t.attr == "kv" for t in targets):
                breaches.append(f"line {node.lineno}: the KV manager held under another name")
    return used, breaches


def test_the_scheduler_uses_only_the_kv_manager_calls_its_module_doc_lists():
    listed = listed_calls()
    assert 8 <= len(listed) <= 11, f"the scheduler's interface to the KV manager: {sorted(listed)}"
    for path in SCHEDULING_FILES:
        used, breaches = kv_manager_use(path.read_text(encoding="utf-8"))
        assert used <= listed, f"{path.name} uses KV manager members it does not list: {sorted(used - listed)}"
        assert not breaches, f"{path.name}: {breaches}"
    used_anywhere = set().union(*(kv_manager_use(p.read_text(encoding="utf-8"))[0] for p in SCHEDULING_FILES))
    assert used_anywhere == listed, f"listed but unused: {sorted(listed - used_anywhere)}"


def test_every_listed_call_is_a_member_of_the_kv_manager():
    from kvstrata.engine.kv_manager import KVCacheManager
    from test_hierarchy import make_stack

    kv = make_stack(device_blocks=4)
    assert isinstance(kv, KVCacheManager)
    assert all(hasattr(kv, name) for name in listed_calls())


def test_the_check_finds_a_scheduler_reaching_into_the_kv_manager():
    """The checker itself: each way around the interface is found."""
    used, breaches = kv_manager_use("self.kv.pool.free_blocks(blocks)\n")
    assert used == {"pool"} and breaches == ["line 1: .pool"]
    used, breaches = kv_manager_use("kv = self.kv\nkv.free(request)\n")
    assert breaches == ["line 1: the KV manager held under another name"]
    _, breaches = kv_manager_use("request.hits.cached_tokens_by_tier = {}\n")
    assert breaches == ["line 1: .hits"]
    used, breaches = kv_manager_use("self.kv = kv_manager\nself.kv.allocate_slots(request, 1)\n")
    assert used == {"allocate_slots"} and not breaches
