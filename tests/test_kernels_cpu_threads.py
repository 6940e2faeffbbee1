"""The compiled CPU kernels' thread pool (kernels/cpu_threads.h): calls made at once from several Python threads
(ctypes releases the GIL, so an engine's step and, say, an offline `LLM` in the same process may both be in a
kernel) and calls in a forked child (whose pool threads did not survive the fork) must each give the one-thread
bits, and never hang."""
from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch

from kvstrata.kernels import cpu_layer_ops, cpu_linear

pytestmark = pytest.mark.skipif(not (cpu_linear.available() and cpu_layer_ops.available()),
                                reason="no C compiler to build the CPU kernels")


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def product_problem(seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(24, 256, generator=gen)
    weight = (torch.randn(256, 384, generator=gen) / 16).t()   # stored [in, out], as the CPU decoder's
    return x, weight


def norm_problem(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(300, 512, generator=gen), torch.randn(512, generator=gen)


def one_thread_results(seeds):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {seed: (cpu_linear.linear(*product_problem(seed)),
                       cpu_layer_ops.rms_norm(*norm_problem(seed), 1e-5)[0]) for seed in seeds}
    finally:
        torch.set_num_threads(before)


def test_calls_from_several_python_threads_at_once_give_the_one_thread_bits(two_threads):
    seeds = range(6)
    expected = one_thread_results(seeds)
    failures: list[str] = []

    def call_many(seed: int) -> None:
        x, weight = product_problem(seed)
        h, w = norm_problem(seed)
        for _ in range(40):
            if not torch.equal(cpu_linear.linear(x, weight), expected[seed][0]):
                failures.append(f"linear, seed {seed}")
            if not torch.equal(cpu_layer_ops.rms_norm(h, w, 1e-5)[0], expected[seed][1]):
                failures.append(f"rms_norm, seed {seed}")

    workers = [threading.Thread(target=call_many, args=(seed,)) for seed in seeds]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert not any(worker.is_alive() for worker in workers), "a kernel call hung"
    assert failures == []


def _child(queue, x, weight) -> None:
    # only the kernel runs here: torch's own OpenMP threads do not survive a fork either, and its parallel ops
    # can hang in a forked child; the inputs come from the parent
    torch.set_num_threads(2)
    queue.put(cpu_linear.linear(x, weight).numpy().tobytes())


def test_a_forked_child_starts_its_own_pool(two_threads):
    x, weight = product_problem(0)
    expected = cpu_linear.linear(x, weight)   # the parent's pool threads now run; a fork copies none of them
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child, args=(queue, x, weight))
    child.start()
    try:
        result = queue.get(timeout=60)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    assert result == expected.numpy().tobytes()
