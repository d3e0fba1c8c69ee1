"""The CUDA kernels of cuda/ on the CUDA emulator (specdecode._cuda_emu), against the CPU backend.

No GPU is needed. ``_cuda_emu`` is the binding code of ``_C`` compiled with the emulator: every
host array takes the CUDA dispatch (the same validation, workspace layout and launchers as on a
GPU), and the kernels, compiled by the host compiler, run with one fiber per GPU thread
(cuda/emu/cuda_runtime_api.h). The tests route the public ops through it (``on_emulator``) and
compare with the CPU backend: verify and sample token for token (the issue's "CPU and CUDA
produce identical tokens"), tree_attention within each dtype's tolerance against the CPU and the
float64 reference, compact_kv, tree_info and tree_paths exactly. Thread orders between barriers
(forward, reverse, shuffled) vary, so a kernel that reads shared memory without its barrier
gives a different result under some order; the emulator's own checks (divergent barriers,
shuffles naming exited lanes, launch limits) fail the launch with a message.
"""

from __future__ import annotations

import collections
import contextlib
import os
import resource
import signal
import subprocess
import sys

import pytest
import torch
from reference_attention import compact_kv_ref, tree_attention_ref
from reference_engine import greedy_reference, tiny_transformer
from reference_tree import random_parents as random_tree_parents
from specdecode._ops import attention as attention_module
from specdecode._ops import tree as tree_module
from specdecode._ops import verify as verify_module
from specdecode.drafters import CachebackDrafter, ModelDrafter
from test_ops_attention import (
    TOL,
    all_halves,
    convert_16bit,
    floats_around_halves,
    make_case,
    poison_key,
)
from test_ops_attention import random_parents as random_attention_parents
from test_ops_verify import backend_parity_cases, final_draw_cases, seeds, tree_limit_cases

from specdecode import SpeculativeDecoder, ops

_BUILT_BY_DEFAULT = sys.platform.startswith("linux") and os.environ.get(
    "SPECDECODE_CUDA_EMU", "ON"
).upper() not in ("OFF", "0", "FALSE")
try:
    from specdecode import _cuda_emu as emu
except ImportError:
    if _BUILT_BY_DEFAULT:
        raise  # a default Linux build has the module: its absence is a build failure
    emu = None

pytestmark = pytest.mark.skipif(
    emu is None,
    reason="specdecode._cuda_emu is built on Linux only, unless SPECDECODE_CUDA_EMU=OFF",
)

SCHEDULES = ["forward", "reverse", "shuffled"]


class EmulatedCuda:
    """Stands in for ``_C`` in the ops modules: the same functions on ``_cuda_emu``, with the
    device buffers the ops allocate only for CUDA inputs (verify's workspace and final-draw
    slices, tree_attention's split partials) allocated on the host."""

    def __init__(self, slices: int, splits: int):
        self.slices = slices
        self.splits = splits
        self.calls: collections.Counter = collections.Counter()

    def verify(self, *args):
        self.calls["verify"] += 1
        args = list(args)
        if args[-2] is None:  # workspace
            target = args[0]
            size = emu.verify_workspace_bytes(target.shape[0], target.shape[-1])
            args[-2] = torch.empty((size,), dtype=torch.uint8)
            args[-1] = self.slices
        return emu.verify(*args)

    def tree_attention(self, q, k, v, lens, mask, out, lse, status, scale, part_o, part_lse, s):
        self.calls["tree_attention"] += 1
        if part_o is None and k.dim() == 4:
            b, t, hq, d = q.shape
            part_o = torch.empty((self.splits, b, t, hq, d))
            part_lse = torch.empty((self.splits, b, t, hq))
        return emu.tree_attention(q, k, v, lens, mask, out, lse, status, scale, part_o, part_lse, s)

    def __getattr__(self, name):
        self.calls[name] += 1
        return getattr(emu, name)


@contextlib.contextmanager
def on_emulator(schedule: str = "forward", seed: int = 0, slices: int = 3, splits: int = 2):
    """Runs the ops inside the block on the emulated CUDA path; checks that kernels ran."""
    native = EmulatedCuda(slices, splits)
    saved = [m._C for m in (verify_module, attention_module, tree_module)]
    for m in (verify_module, attention_module, tree_module):
        m._C = native
    emu.set_schedule(schedule, seed)
    launches = emu.stats()["launches"]
    try:
        yield native
    finally:
        for m, c in zip((verify_module, attention_module, tree_module), saved):
            m._C = c
        emu.set_schedule("forward", 0)
    assert emu.stats()["launches"] > launches, "no kernel ran on the emulator"


# ---- the emulator itself -------------------------------------------------------------------


def cuda_shuffle_source(kind: str, lane: int, arg: int, width: int) -> int:
    """The lane a shuffle reads, by the CUDA programming guide's rules (own lane where the rules
    return the caller's value)."""
    group = lane - lane % width
    if kind == "idx":
        return group + arg % width
    if kind == "xor":
        src = lane ^ arg
        return lane if src >= group + width else src
    if kind == "up":
        return lane if lane - arg < group else lane - arg
    return lane if lane + arg >= group + width else lane + arg  # down


def test_shuffles_follow_the_cuda_rules():
    out = torch.zeros(8 * 32, dtype=torch.int32)
    assert emu._selftest_shuffles(out) == 8
    got = out.view(8, 32).tolist()
    cases = [
        ("idx", lambda lane: 5, 32),
        ("idx", lambda lane: lane + 1, 32),
        ("idx", lambda lane: 3, 8),
        ("xor", lambda lane: 1, 32),
        ("xor", lambda lane: 8, 8),
        ("up", lambda lane: 2, 32),
        ("down", lambda lane: 3, 16),
        ("idx", lambda lane: 7, 8),
    ]
    for k, (kind, arg, width) in enumerate(cases):
        want = [100 + cuda_shuffle_source(kind, lane, arg(lane), width) for lane in range(32)]
        assert got[k] == want, (k, kind)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_barrier_orders_shared_memory_and_its_absence_shows(schedule):
    """Each thread writes its slot, then reads its neighbour's. With the barrier every read sees
    the write under every order; without it some reads see shared memory as it started (NaN)."""
    emu.set_schedule(schedule, 7)
    try:
        for threads in (32, 256):
            out = torch.zeros(threads)
            assert emu._selftest_neighbour(out, threads, True) == ""
            want = [float((t + 1) % threads) for t in range(threads)]
            assert out.tolist() == want
            out = torch.zeros(threads)
            assert emu._selftest_neighbour(out, threads, False) == ""
            assert torch.isnan(out).any() and out.tolist() != want
    finally:
        emu.set_schedule("forward", 0)


@pytest.mark.parametrize(
    "rule,message",
    [
        (
            "divergent_barrier",
            "48 threads wait at __syncthreads that 16 threads of the block exited",
        ),
        ("exited_lane", "names lane 0, which has exited"),
        ("foreign_mask", "reads lane 20 in a shuffle whose mask does not name it"),
        ("shared_memory", "65536 bytes of dynamic shared memory, but the kernel allows 49152"),
        ("block_size", "invalid launch configuration: grid (1, 1, 1), block (2048, 1, 1)"),
        ("partial_warp_mma", "at mma.sync names lane 16, which has exited"),
    ],
)
def test_broken_rules_fail_the_launch_with_a_message(rule, message):
    assert message in emu._selftest_rule(rule)
    # The emulator recovers: the next launch runs.
    assert emu._selftest_rule("shared_memory_allowed") == ""


def test_shared_memory_starts_undefined_in_every_block():
    out = torch.zeros(2)
    assert emu._selftest_static_shared(out) == ""
    assert torch.isnan(out).all(), out  # not 1.0, the first block's write
    out = torch.zeros(64)
    assert emu._selftest_neighbour(out, 64, False) == ""
    assert torch.isnan(out).any()


def test_a_write_past_dynamic_shared_memory_faults():
    code = "import specdecode._cuda_emu as e; e._selftest_shared_overflow(); print('survived')"

    def no_core_file():
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=no_core_file,
    )
    assert proc.returncode == -signal.SIGSEGV, (proc.returncode, proc.stdout, proc.stderr)
    assert "survived" not in proc.stdout


@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_gives_each_lane_the_ptx_layout(trans):
    """One emulated ldmatrix.x4 over the four 8 x 8 quadrants of a [16, 16] matrix: register i of
    lane l (g = l // 4, t = l % 4) holds elements [g][2t], [g][2t+1] of quadrant i, or with .trans
    [2t][g], [2t+1][g], the lower-numbered in the low half (PTX ISA, ldmatrix)."""
    m = torch.arange(256, dtype=torch.int16).reshape(16, 16)  # element = its own index
    out = torch.full((32, 4), -1, dtype=torch.int32)
    assert emu._selftest_ldmatrix(m.view(torch.bfloat16), trans, out) == ""
    got = out.numpy().view("uint32")
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(4):
            r0, c0 = 8 * (i % 2), 8 * (i // 2)
            if trans:
                lo, hi = (r0 + 2 * t) * 16 + c0 + g, (r0 + 2 * t + 1) * 16 + c0 + g
            else:
                lo, hi = (r0 + g) * 16 + c0 + 2 * t, (r0 + g) * 16 + c0 + 2 * t + 1
            assert got[lane, i] == lo | (hi << 16), (lane, i, hex(int(got[lane, i])))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mma_multiplies_the_fragments_of_the_ptx_layout(dtype):
    """One emulated mma.sync m16n8k16: each lane loads its fragments of a [16, 16] and b [16, 8]
    by the layout cuda/mma.cuh documents; the product lands where that layout says."""
    gen = torch.Generator().manual_seed(11)
    a = torch.randn(16, 16, generator=gen).to(dtype)
    b = torch.randn(16, 8, generator=gen).to(dtype)
    d = torch.full((16, 8), float("nan"))
    emu.reset_stats()
    assert emu._selftest_mma(a, b, dtype == torch.bfloat16, d) == ""
    assert emu.stats()["mmas"] == 1
    want = a.double() @ b.double()
    assert (d.double() - want).abs().max().item() < 1e-5
    # Transposed halves or swapped rows would not pass: the product is not symmetric.
    assert (d.double() - (a.double().T @ b.double())).abs().max().item() > 0.1


def test_16bit_conversion_kernels_equal_the_host():
    """cuda/halves.cu's kernels (on the emulator: host_device.h's bit code, as on the CPU) cover
    every element of a grid whose size is not a multiple of the block's."""
    cases = ((all_halves()[:4465], torch.float32), (floats_around_halves(), torch.float16))
    for src, dtype in cases:
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        host = convert_16bit(src, dtype)
        assert torch.equal(convert_16bit(src, dtype, module=emu).view(bits), host.view(bits))


def test_stats_count_the_work():
    emu.reset_stats()
    out = torch.zeros(64)
    emu._selftest_neighbour(out, 64, True)
    s = emu.stats()
    assert s["launches"] == 1 and s["blocks"] == 1 and s["threads"] == 64
    assert s["block_barriers"] == 1 and s["shuffles"] == 0
    with pytest.raises(ValueError, match="schedule"):
        emu.set_schedule("sideways")


# ---- verify and sample ---------------------------------------------------------------------


def assert_same_result(cpu, emulated, what):
    for name, x, y in zip(cpu._fields, cpu, emulated):
        assert torch.equal(x, y), (what, name, x, y)


@pytest.mark.parametrize("v", [50, 3001, 4352])
@pytest.mark.parametrize("slices", [1, 3, 64])
def test_verify_final_draws_equal_the_cpu(v, slices):
    """Every kind of final draw (bonus, residual corrections at each level, p_L, the row without
    the tried tokens, greedy, relaxed, typical, top-k acceptance, bad draft rows), with the
    vocabulary's chunks cut into `slices` slices (one thread block each)."""
    b = 12
    for i, (target, tokens, kw) in enumerate(final_draw_cases(v)):
        cpu = ops.verify(target, tokens, seed=seeds(b), offset=i, **kw)
        with on_emulator(slices=slices):
            got = ops.verify(target, tokens, seed=seeds(b), offset=i, **kw)
        assert_same_result(cpu, got, (v, i, sorted(kw)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_verify_equals_the_cpu_token_for_token(dtype):
    """The cases of the GPU test (tests/test_ops_verify.py::test_cuda_matches_cpu_token_for_token)
    at smaller vocabularies, most ending in a partial chunk, and one of the issue's large ones."""
    gen = torch.Generator().manual_seed(110)
    for v, b, n in ((50, 64, 6), (3001, 8, 5), (50257, 3, 6), (128256, 1, 5)):
        logits, tokens, cases = backend_parity_cases(gen, v, b, n, dtype)
        for kw in cases:
            cpu = ops.verify(logits, tokens, seed=seeds(b), offset=3, **kw)
            with on_emulator():
                got = ops.verify(logits, tokens, seed=seeds(b), offset=3, **kw)
            assert_same_result(cpu, got, (v, dtype, sorted(kw)))
        row = logits[:, 0].contiguous()
        for args in ((0.8, 30, 0.95), (1.0, 0, 1.0), (0.0, 0, 1.0)):
            cpu = ops.sample(row, *args, seed=seeds(b), offset=1)
            with on_emulator():
                got = ops.sample(row, *args, seed=seeds(b), offset=1)
            assert torch.equal(cpu.tokens, got.tokens) and torch.equal(cpu.status, got.status)
        for args in ((0.8, 30, 0.95), (1.0, 0, 1.0), (0.0, 0, 1.0), (0.6, 0, 0.9)):
            cpu = ops.sampling_probs(row, *args)
            with on_emulator():
                got = ops.sampling_probs(row, *args)
            assert torch.equal(cpu.probs, got.probs), (v, dtype, args)
            assert torch.equal(cpu.status, got.status)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_verify_is_independent_of_the_thread_order(schedule):
    gen = torch.Generator().manual_seed(5)
    b, n, v = 16, 7, 2000
    logits = torch.randn(b, n, v, generator=gen) * 2
    q = torch.softmax(torch.randn(b, n, v, generator=gen) * 2, -1)
    tokens = torch.randint(0, v, (b, n), generator=gen)
    tree = torch.tensor([-1, 0, 0, 1, 1, 2, 2], dtype=torch.int32).expand(b, n).contiguous()
    for kw in (dict(draft_probs=q, parents=tree), dict(top_k=9, top_p=0.8), dict(parents=tree)):
        cpu = ops.verify(logits, tokens, seed=seeds(b), offset=1, **kw)
        with on_emulator(schedule, seed=11, slices=4):
            got = ops.verify(logits, tokens, seed=seeds(b), offset=1, **kw)
        assert_same_result(cpu, got, (schedule, sorted(kw)))


def test_verify_tree_limits_equal_the_cpu():
    """The block executor's tree_limits (the leader's pass in shared memory) flags the rows the
    CPU's does, whatever the seed."""
    for target, tokens, parents, max_depth in tree_limit_cases():
        for seed in range(3):
            kw = dict(parents=parents, seed=seed, offset=0, temperature=1.0, check=False)
            if max_depth is not None:
                kw["max_depth"] = max_depth
            cpu = ops.verify(target, tokens, **kw)
            with on_emulator():
                got = ops.verify(target, tokens, **kw)
            assert_same_result(cpu, got, ("tree limits", seed))
            assert cpu.status.tolist()[0] in (64, 128)


def test_verify_non_finite_rows_padding_and_validation():
    v = 1024
    logits = torch.randn(6, 2, v, generator=torch.Generator().manual_seed(4))
    logits[0, 0, 300] = float("inf")
    logits[1, 1, 700] = float("nan")
    logits[2, 0, 256:768] = -float("inf")
    logits[3, 0, :] = -float("inf")
    tokens = torch.ones(6, 2, dtype=torch.int32)
    allow = torch.ones(6, 2, dtype=torch.bool)
    cpu = ops.verify(logits, tokens, allow=allow, seed=0, offset=0)
    with on_emulator():
        got = ops.verify(logits, tokens, allow=allow, seed=0, offset=0)
    assert_same_result(cpu, got, "non-finite")
    assert got.status.tolist()[:4] == [1, 1, 0, 2]
    # Probability rows whose float32 sum overflows (finite entries), in a whole chunk.
    probs = torch.softmax(logits.nan_to_num(0.0, 0.0, 0.0), -1)
    probs[4, 0, 256:260] = torch.tensor([1e38, 3e38, 2e38, 1e37])
    probs[5, 1, 256:258] = torch.tensor([1e38, 2e38])  # 3e38 in all: valid
    cpu = ops.verify(probs, tokens, allow=allow, target_is_logits=False, seed=0, offset=0)
    with on_emulator():
        got = ops.verify(probs, tokens, allow=allow, target_is_logits=False, seed=0, offset=0)
    assert_same_result(cpu, got, "overflowing sum")
    assert got.status.tolist()[4:] == [1, 0]
    logits = torch.randn(3, 5, 10)
    parents = torch.tensor(
        [[-1, 0, 0, -1, -1], [-1, 0, 1, 2, -1], [-1, 0, 0, 1, 1]], dtype=torch.int32
    )
    tokens = torch.tensor([[0, 1, 2, -1, -1], [0, 1, 2, 3, -1], [0, 1, 2, 3, 4]])
    allow = torch.ones(3, 5, dtype=torch.bool)
    cpu = ops.verify(logits, tokens, parents=parents, allow=allow, seed=0, offset=0)
    with on_emulator():
        got = ops.verify(logits, tokens, parents=parents, allow=allow, seed=0, offset=0)
        with pytest.raises(ValueError, match="tokens"):
            ops.verify(logits, tokens + 10, parents=parents, seed=0, offset=0)
    assert_same_result(cpu, got, "padding")
    # Greedy trees with a judge's allow mask: the argmax child before an allowed sibling.
    logits = torch.randn(4, 6, 10, generator=torch.Generator().manual_seed(5))
    parents = torch.tensor([[-1, 0, 0, 0, 2, 2]] * 4, dtype=torch.int32)
    tokens = torch.cat(
        [torch.zeros(4, 1, dtype=torch.int64), logits[:, [0, 0, 0, 2, 2]].argmax(-1)], 1
    )
    tokens[0, 1] = (tokens[0, 2] + 1) % 10  # row 0: an allowed mismatch before the argmax child
    tokens[1, 1:4] = (tokens[1, 1:4] + 1) % 10  # row 1: no argmax child, two allowed
    allow = torch.tensor([[0, 1, 0, 1, 1, 0]] * 4, dtype=torch.bool)
    args = dict(parents=parents, allow=allow, temperature=0.0, seed=0, offset=0)
    cpu = ops.verify(logits, tokens, **args)
    with on_emulator():
        got = ops.verify(logits, tokens, **args)
    assert_same_result(cpu, got, "greedy allow")
    assert cpu.path[0, 1] == 2 and cpu.path[1, 1] == 1


# ---- tree attention and KV compaction ------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("t,prefix,splits", [(1, 0, 1), (1, 700, 3), (7, 300, 2), (40, 90, 1)])
def test_tree_attention_equals_the_cpu_and_reference(dtype, d, t, prefix, splits):
    """GQA 4 (8 query heads, 2 KV heads), strided caches, prefixes of different lengths per row;
    T = 40 makes 160 query rows per KV head, several thread blocks of 32 rows; splits > 1 runs
    the merge kernel, and a split longer than some rows' prefix is empty."""
    q, k, v, lens, gen = make_case(2, t, 8, 2, d, [prefix, prefix // 3], dtype, strided=True)
    mask = ops.tree_info(random_attention_parents(2, t, gen)).mask
    for m in (mask, None):
        cpu_out, cpu_lse = ops.tree_attention(q, k, v, lens, m, return_lse=True)
        with on_emulator(splits=splits):
            out, lse = ops.tree_attention(q, k, v, lens, m, return_lse=True)
        ref_out, _ = tree_attention_ref(q, k, v, lens, m)
        assert (out.double() - ref_out).abs().max().item() <= TOL[dtype]
        assert (out.float() - cpu_out.float()).abs().max().item() <= TOL[dtype]
        fin = torch.isfinite(cpu_lse)
        assert torch.equal(torch.isfinite(lse), fin)
        assert (lse - cpu_lse)[fin].abs().max().item() < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 80])
@pytest.mark.parametrize("t,prefix,splits", [(1, 300, 3), (9, 90, 1)])
def test_tree_attention_of_a_cache_off_16_byte_boundaries(dtype, d, t, prefix, splits):
    """Head slots of d + 1 elements: K/V rows start off 16-byte boundaries, and the kernel
    loads its tiles element by element instead of in 16-byte chunks."""
    q, k, v, lens, gen = make_case(2, t, 8, 2, d, [prefix, prefix // 3], dtype, strided="odd")
    mask = ops.tree_info(random_attention_parents(2, t, gen)).mask
    cpu_out = ops.tree_attention(q, k, v, lens, mask)
    with on_emulator(splits=splits):
        out = ops.tree_attention(q, k, v, lens, mask)
    ref_out, _ = tree_attention_ref(q, k, v, lens, mask)
    assert (out.double() - ref_out).abs().max().item() <= TOL[dtype]
    assert (out.float() - cpu_out.float()).abs().max().item() <= TOL[dtype]


def test_tree_attention_of_a_256_node_tree():
    """T = 256: eight mask words per row, 32 thread blocks of rows per KV head, a tree part of
    eight key tiles."""
    q, k, v, lens, gen = make_case(2, 256, 8, 2, 128, [33, 11], torch.bfloat16, strided=True)
    mask = ops.tree_info(random_attention_parents(2, 256, gen)).mask
    cpu_out, cpu_lse = ops.tree_attention(q, k, v, lens, mask, return_lse=True)
    with on_emulator(splits=2):
        out, lse = ops.tree_attention(q, k, v, lens, mask, return_lse=True)
    ref_out, _ = tree_attention_ref(q, k, v, lens, mask)
    assert (out.double() - ref_out).abs().max().item() <= TOL[torch.bfloat16]
    assert (out.float() - cpu_out.float()).abs().max().item() <= TOL[torch.bfloat16]
    assert (lse - cpu_lse).abs().max().item() < 1e-3


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tree_attention_is_independent_of_the_thread_order(schedule):
    q, k, v, lens, gen = make_case(3, 9, 8, 2, 64, [70, 33, 0], torch.float32, seed=3)
    mask = ops.tree_info(random_attention_parents(3, 9, gen)).mask
    cpu_out, cpu_lse = ops.tree_attention(q, k, v, lens, mask, return_lse=True)
    with on_emulator(schedule, seed=2, splits=3):
        out, lse = ops.tree_attention(q, k, v, lens, mask, return_lse=True)
    assert (out - cpu_out).abs().max().item() <= TOL[torch.float32]
    assert (lse - cpu_lse).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("strided", [True, "odd"])
@pytest.mark.parametrize("capability", [(9, 0), (8, 0), (7, 5)])
def test_tree_attention_takes_the_tensor_cores_where_it_can(dtype, strided, capability):
    """fp16 / bf16 caches on 16-byte boundaries on sm_80+ run attend_mma_kernel (tensor-core
    products); fp32, caches off 16-byte boundaries and older devices run the CUDA-core kernel.
    Every path equals the CPU and the reference."""
    q, k, v, lens, gen = make_case(2, 9, 8, 2, 64, [150, 40], dtype, strided=strided, seed=6)
    mask = ops.tree_info(random_attention_parents(2, 9, gen)).mask
    cpu_out, cpu_lse = ops.tree_attention(q, k, v, lens, mask, return_lse=True)
    emu.set_compute_capability(*capability)
    emu.reset_stats()
    try:
        with on_emulator(splits=2):
            out, lse = ops.tree_attention(q, k, v, lens, mask, return_lse=True)
        mmas = emu.stats()["mmas"]
    finally:
        emu.set_compute_capability(9, 0)
    tensor_cores = dtype != torch.float32 and strided is True and capability >= (8, 0)
    assert (mmas > 0) == tensor_cores, mmas
    ref_out, _ = tree_attention_ref(q, k, v, lens, mask)
    assert (out.double() - ref_out).abs().max().item() <= TOL[dtype]
    assert (out.float() - cpu_out.float()).abs().max().item() <= TOL[dtype]
    assert (lse - cpu_lse).abs().max().item() < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "t,prefix,where", [(1, 700, "prefix"), (9, 150, "prefix"), (9, 150, "tree")]
)
def test_tree_attention_non_finite_scores_make_the_same_nan_rows(dtype, t, prefix, where):
    """A +inf score: the CUDA-core kernel (fp32) and the tensor-core kernel (bf16), split in 3,
    give NaN in the same rows as the CPU (the merge kernels keep the NaN), the rest equal."""
    q, k, v, lens, _ = make_case(2, t, 8, 2, 64, prefix, seed=4)
    poison_key(k, q, 0, prefix // 3 if where == "prefix" else prefix + t - 1, 1)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    cpu_out, cpu_lse = ops.tree_attention(q, k, v, lens, None, return_lse=True)
    emu.reset_stats()
    with on_emulator(splits=3):
        out, lse = ops.tree_attention(q, k, v, lens, None, return_lse=True)
    assert (emu.stats()["mmas"] > 0) == (dtype == torch.bfloat16)
    nan = cpu_lse.isnan()
    assert bool(nan.any()) and torch.equal(lse.isnan(), nan)
    assert torch.equal(out.isnan().all(-1), nan) and not bool(out[~nan].isnan().any())
    assert (out[~nan].float() - cpu_out[~nan].float()).abs().max().item() <= TOL[dtype]


@pytest.mark.parametrize("t,prefix", [(1, 500), (5, 37), (9, 0), (64, 70)])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (8, 8), (16, 2)])
def test_tree_attention_on_the_tensor_cores_in_every_row_grouping(t, prefix, hq, hkv):
    """attend_mma_kernel groups 16 query rows per warp and splits each tile's keys among the
    warps of a group: T = 1 and 5 (4 and 20 rows per KV head at GQA 4) run one or two row
    groups with their keys on four or two warps, merged in shared memory; T = 64 at GQA 1 four
    groups, one per warp, as T = 9 at GQA 8 (72 rows: two row tiles); T = 64 at GQA 4 and 8
    two groups per warp in blocks of 128 rows (their 64-row grid fills the emulated device's
    4 SMs four times over), two and four row tiles; an empty prefix leaves only the masked
    tree. One split and three."""
    for splits in (1, 3):
        q, k, v, lens, gen = make_case(2, t, hq, hkv, 128, [prefix, prefix // 2], torch.float16)
        mask = ops.tree_info(random_attention_parents(2, t, gen)).mask
        cpu_out, cpu_lse = ops.tree_attention(q, k, v, lens, mask, return_lse=True)
        emu.reset_stats()
        with on_emulator(splits=splits):
            out, lse = ops.tree_attention(q, k, v, lens, mask, return_lse=True)
        assert emu.stats()["mmas"] > 0
        ref_out, _ = tree_attention_ref(q, k, v, lens, mask)
        assert (out.double() - ref_out).abs().max().item() <= TOL[torch.float16]
        assert (out.float() - cpu_out.float()).abs().max().item() <= TOL[torch.float16]
        fin = torch.isfinite(cpu_lse)
        assert torch.equal(torch.isfinite(lse), fin)
        assert (lse - cpu_lse)[fin].abs().max().item() < 1e-3


@pytest.mark.parametrize(
    "capability,d,batch,rows,block_rows",
    [
        # two row groups per warp: 104 KiB of shared memory fits, and B x Hkv x 4 64-row
        # blocks = 16 fill the emulated device's 4 SMs four times over
        ((9, 0), 128, 2, 256, 128),
        ((9, 0), 128, 1, 256, 64),  # 8 blocks of 64 rows: half as many would leave SMs idle
        ((8, 0), 128, 2, 256, 128),
        ((8, 6), 128, 2, 256, 64),  # 99 KiB per block: one group per warp
        ((8, 9), 96, 2, 256, 128),  # D 96: 78 KiB fits
        ((9, 0), 256, 2, 256, 64),  # 32 rows' accumulators at D 256 overflow the registers
        ((9, 0), 96, 4, 65, 128),
        ((9, 0), 96, 4, 64, 64),
        ((9, 0), 128, 2, 20, 32),
        ((9, 0), 128, 2, 4, 16),
        ((7, 5), 128, 2, 256, 32),  # no tensor cores: the CUDA-core kernel's 32 rows
    ],
)
def test_tree_attention_block_rows_follow_the_device(capability, d, batch, rows, block_rows):
    """The rows per thread block that the split count is sized by (tree_attention_block_rows)
    are the ones the launcher runs: B x Hkv x ceil(rows / block_rows) blocks at one split, and
    the output right; fp32 always takes the CUDA-core kernel's 32."""
    gq = 4 if rows % 4 == 0 else 1
    t = rows // gq
    prefix = [40, 7, 0, 13][:batch]
    q, k, v, lens, gen = make_case(batch, t, 2 * gq, 2, d, prefix, torch.bfloat16, seed=8)
    mask = ops.tree_info(random_attention_parents(batch, t, gen)).mask
    cpu_out = ops.tree_attention(q, k, v, lens, mask)
    emu.set_compute_capability(*capability)
    try:
        assert emu.tree_attention_block_rows(batch, 2, rows, d, False, 0) == block_rows
        assert emu.tree_attention_block_rows(batch, 2, rows, d, True, 0) == 32
        emu.reset_stats()
        with on_emulator(splits=1):
            out = ops.tree_attention(q, k, v, lens, mask)
        blocks = emu.stats()["blocks"]
    finally:
        emu.set_compute_capability(9, 0)
    assert blocks == batch * 2 * -(-rows // block_rows)
    assert (out.float() - cpu_out.float()).abs().max().item() <= TOL[torch.bfloat16]
    for bad in range(4):
        args = [batch, 2, rows, d]
        args[bad] = 0
        with pytest.raises(ValueError, match="expected at least 1"):
            emu.tree_attention_block_rows(*args, False, 0)


@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tree_attention_two_row_groups_per_warp(d, dtype):
    """Blocks of 128 rows (two row groups per warp, each K and V fragment used by both): T = 33
    at GQA 4 is 132 rows, a full row tile and one of 4 rows (B 3 x Hkv 2 x 3 64-row blocks fill
    the emulated 4 SMs four times over); ragged prefixes, one sequence with none, a random tree;
    1 and 2 splits. D = 256 takes 64-row blocks and must agree too."""
    q, k, v, lens, gen = make_case(3, 33, 8, 2, d, [90, 0, 301], dtype, seed=9)
    mask = ops.tree_info(random_attention_parents(3, 33, gen)).mask
    cpu_out, cpu_lse = ops.tree_attention(q, k, v, lens, mask, return_lse=True)
    ref_out, _ = tree_attention_ref(q, k, v, lens, mask)
    for splits in (1, 2):
        emu.reset_stats()
        with on_emulator(splits=splits):
            out, lse = ops.tree_attention(q, k, v, lens, mask, return_lse=True)
        tiles = 2 if d <= 128 else 3
        merge = 0 if splits == 1 else -(-3 * 33 * 8 // 4)  # one warp per output row, 4 a block
        assert emu.stats()["blocks"] == 3 * 2 * tiles * splits + merge
        assert (out.double() - ref_out).abs().max().item() <= TOL[dtype]
        assert (out.float() - cpu_out.float()).abs().max().item() <= TOL[dtype]
        assert (lse - cpu_lse).abs().max().item() < 1e-3


def test_tree_attention_rejects_a_bad_prefix():
    q, k, v, _, _ = make_case(2, 4, 4, 2, 64, [10, 3], seed=4)
    with on_emulator(), pytest.raises(ValueError, match="prefix"):
        ops.tree_attention(q, k, v, torch.tensor([100, 0], dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compact_kv_equals_the_reference_with_overlapping_moves(dtype):
    _, k, v, _, _ = make_case(3, 8, 4, 2, 64, [10, 3, 0], dtype, strided=True, seed=41)
    lens = torch.tensor([10, 3, 0], dtype=torch.int32)
    # Row 0 moves nodes onto slots that later moves read from (overlap); row 2 keeps its order.
    path = torch.tensor([[0, 2, 3, 5], [0, 1, 4, -1], [0, 1, 2, 3]], dtype=torch.int32)
    acc = torch.tensor([4, 3, 4], dtype=torch.int32)
    ref_k, ref_v, ref_lens = compact_kv_ref(k, v, lens, path, acc)
    with on_emulator():
        new_lens = ops.compact_kv(k, v, lens, path, acc)
    assert torch.equal(new_lens, ref_lens)
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)
    before = (k.clone(), v.clone())
    bad = torch.tensor([[0, 2, 2, 5], [0, 1, 4, -1], [0, 1, 2, 3]], dtype=torch.int32)
    with on_emulator(), pytest.raises(ValueError, match="strictly increasing"):
        ops.compact_kv(k, v, lens, bad, acc)
    # All or nothing: an invalid row cancels every move.
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])


# ---- the caller's current device ------------------------------------------------------------


@pytest.fixture
def three_devices():
    """Three emulated devices, none used yet (device 0 current), the ops' arrays on device 2."""
    emu.reset_devices(3, 2)
    try:
        yield
    finally:
        emu.reset_devices(1, 0)


def _device_op_cases():
    """One call of each op family that launches kernels (one binding function each)."""
    q, k, v, lens, _ = make_case(2, 4, 4, 2, 64, [10, 3], torch.bfloat16, seed=5)
    parents = random_tree_parents(torch.Generator().manual_seed(3), batch=2, n=9, pad_max=2)
    logits, tokens, cases = backend_parity_cases(
        torch.Generator().manual_seed(4), 50, 4, 3, torch.float32
    )
    row = logits[:, 0].contiguous()
    path = torch.tensor([[0, 2], [0, 1]], dtype=torch.int32)
    accepted = torch.tensor([2, 1], dtype=torch.int32)
    return {
        "tree_attention": lambda: ops.tree_attention(q, k, v, lens),
        "compact_kv": lambda: ops.compact_kv(k.clone(), v.clone(), lens, path, accepted),
        "tree_info": lambda: ops.tree_info(parents),
        "tree_paths": lambda: ops.tree_paths(parents),
        "verify": lambda: ops.verify(logits, tokens, seed=seeds(4), offset=0, **cases[0]),
        "sampling_probs": lambda: ops.sampling_probs(row, 0.8, 30, 0.95),
        "convert_16bit": lambda: convert_16bit(row.flatten(), torch.float16, module=emu),
    }


DEVICE_OPS = (
    "compact_kv",
    "convert_16bit",
    "sampling_probs",
    "tree_attention",
    "tree_info",
    "tree_paths",
    "verify",
)


@pytest.mark.parametrize("op", DEVICE_OPS)
def test_ops_run_on_their_arrays_device_and_give_the_callers_back(three_devices, op):
    """An op on another device's arrays launches there and leaves the caller's current device
    as it was (as torch's device guards do): a caller on cuda:1 still is after an op on cuda:2."""
    call = _device_op_cases()[op]
    emu.set_device(1)
    with on_emulator():
        call()
    assert emu.stats()["launch_device"] == 2
    assert emu.current_device() == 1
    # Arrays on the current device: nothing to switch.
    emu.set_device(2)
    with on_emulator():
        call()
    assert emu.stats()["launch_device"] == 2 and emu.current_device() == 2


def test_the_callers_device_comes_back_when_the_op_raises(three_devices):
    """The device is given back on every way out, here a bad output found after the switch."""
    parents = torch.tensor([[-1, 0, 0]], dtype=torch.int32)
    emu.set_device(1)
    with pytest.raises(TypeError, match="depth"):
        emu.tree_info(
            parents,
            torch.empty((1, 3), dtype=torch.float32),
            None,
            torch.empty((1,), dtype=torch.int32),
            torch.empty((1, 2), dtype=torch.int32),
            0,
        )
    assert emu.current_device() == 1


def test_no_primary_context_is_created_to_give_a_device_back(three_devices):
    """A thread that never used its current device (0, no primary context): making it current
    again would create that context, so the op's device stays current, as with torch's guards."""
    parents = torch.tensor([[-1, 0, 0]], dtype=torch.int32)
    with on_emulator():
        ops.tree_info(parents)
    assert emu.current_device() == 2
    assert not emu.primary_context_active(0) and not emu.primary_context_active(1)
    emu.set_device(0)  # now the caller has used device 0: it is given back
    with on_emulator():
        ops.tree_info(parents)
    assert emu.current_device() == 0 and emu.stats()["launch_device"] == 2


def test_an_unusable_device_is_a_clear_error_and_leaves_no_error_pending():
    """Arrays on a device the process cannot use (here device 5 of two): the op names the array
    and the runtime's reason, the caller's device stays, and the failed switch leaves no error
    for the next launch's check to report."""
    parents = torch.tensor([[-1, 0, 0]], dtype=torch.int32)

    def tree_info():
        depth = torch.empty((1, 3), dtype=torch.int32)
        status = torch.empty((1, 2), dtype=torch.int32)
        emu.tree_info(parents, depth, None, torch.empty((1,), dtype=torch.int32), status, 0)
        return depth

    emu.reset_devices(2, 5)
    try:
        with pytest.raises(ValueError, match="device 7, but the emulator has 2"):
            emu.set_device(7)
        emu.set_device(1)
        with pytest.raises(RuntimeError, match="parents: cannot use cuda:5: invalid device"):
            tree_info()
        assert emu.current_device() == 1
        emu.reset_devices(2, 0)
        assert tree_info().tolist() == [[0, 1, 1]]
        assert emu.stats()["launch_device"] == 0
    finally:
        emu.reset_devices(1, 0)


# ---- tree_info and tree_paths --------------------------------------------------------------


def test_tree_info_and_paths_equal_the_cpu():
    g = torch.Generator().manual_seed(2)
    for n in (1, 5, 32, 33, 100, 1024):
        parents = random_tree_parents(g, batch=9, n=n, pad_max=n // 2)
        cpu = ops.tree_info(parents)
        with on_emulator():
            got = ops.tree_info(parents)
            paths = ops.tree_paths(parents)
        for a, b in zip(cpu, got):
            assert torch.equal(a, b)
        assert torch.equal(ops.tree_paths(parents), paths)
    bad = torch.tensor([[-1, 0], [-1, 1]], dtype=torch.int32)
    with on_emulator(), pytest.raises(ValueError, match="batch row 1"):
        ops.tree_info(bad)


# ---- the decoding loop ---------------------------------------------------------------------


def test_decoding_in_bf16_on_the_emulated_tensor_core_attention():
    """A bf16 target and draft model decoding with every op emulated: attention runs the
    tensor-core kernel (1 query row per step autoregressively, up to 8 per tree pass), and the
    speculative loop's greedy output equals the same target's own greedy decoding there."""
    target = tiny_transformer(seed=1).to(torch.bfloat16)
    draft = tiny_transformer(seed=2, layers=1).to(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 61, (n,), generator=g).tolist() for n in (2, 9, 5)]
    emu.reset_stats()
    with on_emulator(splits=2):
        expected = [greedy_reference(target, p, 12) for p in prompts]
        drafter = ModelDrafter(draft, mode="tree", k=3, branch=2, beam=2, max_nodes=8)
        out = SpeculativeDecoder(target, drafter).generate(
            prompts, max_new_tokens=12, temperature=0.0
        )
    assert emu.stats()["mmas"] > 0
    assert out.sequences == expected


@pytest.mark.parametrize("drafter", ["cacheback", "tree"])
def test_decoding_on_the_emulated_kernels(drafter):
    """The speculative decoding loop with every op on the emulated CUDA path (tree_info, verify,
    tree_attention in each layer, compact_kv): greedy output equals the target's own greedy
    decoding, and sampling with a seed gives the CPU backend's tokens."""
    target = tiny_transformer(seed=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 61, (n,), generator=g).tolist() for n in (1, 7, 3, 12)]
    expected = [greedy_reference(target, p, 12) for p in prompts]

    def make():
        if drafter == "cacheback":
            return CachebackDrafter(max_nodes=12, max_depth=5, max_sequences=8)
        draft_model = tiny_transformer(seed=2, layers=1)
        return ModelDrafter(draft_model, mode="tree", k=3, branch=2, beam=2, max_nodes=8)

    with on_emulator(splits=2) as native:
        out = SpeculativeDecoder(target, make()).generate(
            prompts, max_new_tokens=12, temperature=0.0
        )
    assert out.sequences == expected
    # Every op of the step went through the emulated CUDA path (tree_attention once per layer
    # and forward pass). compact_kv runs only for an accepted path that is not a prefix of the
    # tree's nodes, which these Cacheback trees have and these model trees happen not to.
    ran = ("tree_info", "verify", "tree_attention") + (
        ("compact_kv",) if drafter == "cacheback" else ()
    )
    for op in ran:
        assert native.calls[op] > 0, (op, native.calls)
    sampled = {}
    for backend in ("cpu", "emulated"):
        ctx = on_emulator(splits=2) if backend == "emulated" else contextlib.nullcontext()
        with ctx:
            sampled[backend] = (
                SpeculativeDecoder(target, make())
                .generate(prompts, max_new_tokens=12, temperature=1.0, seed=5)
                .sequences
            )
    assert sampled["emulated"] == sampled["cpu"]
