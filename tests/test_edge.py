"""Tests of specdecode.edge: drafters on other machines (edge devices) behind one verifying server.

Workers run in threads over pipes (the same wire as a process or a socket) except where the
process or the socket is the point of the test."""

from __future__ import annotations

import itertools
import multiprocessing
import pickle
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from reference_engine import greedy_reference, tiny_transformer
from specdecode.drafters import CachebackDrafter, ModelDrafter, NoDrafter, SampledDraftTree
from specdecode.edge import (
    RemoteDrafter,
    WorkerError,
    WorkerListener,
    _check_answer,
    _tree_message,
    connect_worker,
    serve_drafter,
    spawn_draft_workers,
    zoo_draft_model,
)
from specdecode.specformer import SpecFormerDrafter, SpecFormerHead
from specdecode.steering import DraftSteering

from specdecode import SpeculativeDecoder, generate, ops, zoo

V = 61


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_transformer(seed=1, layers=3)


@pytest.fixture(scope="module")
def draft():
    return tiny_transformer(seed=2, layers=1)


def prompts_for(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (int(3 + 2 * i % 7),), generator=g).tolist() for i in range(n)]


class ThreadWorkers:
    """Each drafter served on a thread at the far end of a pipe."""

    def __init__(self, *drafters: Any) -> None:
        self.connections, self.threads, self.far_ends = [], [], []
        for d in drafters:
            server_end, worker_end = multiprocessing.Pipe()
            t = threading.Thread(target=serve_drafter, args=(worker_end, d), daemon=True)
            t.start()
            self.connections.append(server_end)
            self.far_ends.append(worker_end)
            self.threads.append(t)

    def ended(self, timeout: float = 10.0) -> bool:
        for t in self.threads:
            t.join(timeout)
        return not any(t.is_alive() for t in self.threads)


# ---- decoding through workers -------------------------------------------------------------------


def test_greedy_output_and_acceptance_match_the_same_drafter_run_locally(target, draft):
    """Two workers with the draft model: the same text as autoregressive decoding, and exactly
    the drafts (hence the steps) the same drafter makes in-process."""
    prompts = prompts_for(5, seed=1)
    local = SpeculativeDecoder(target, ModelDrafter(draft, k=3)).generate(
        prompts, max_new_tokens=20
    )
    workers = ThreadWorkers(ModelDrafter(draft, k=3), ModelDrafter(draft, k=3))
    with RemoteDrafter(workers.connections) as drafter:
        out = SpeculativeDecoder(target, drafter).generate(prompts, max_new_tokens=20)
        assert drafter.stats.sequences == [3, 2]  # the less loaded worker first
        assert drafter.stats.rounds[0] > 0 and drafter.stats.rounds[1] > 0
        assert drafter.stats.late == [0, 0] and drafter.stats.bytes_received > 0
        assert drafter.vocab_size == V
    assert workers.ended()  # close() stopped them
    for p, seq in zip(prompts, out.sequences):
        assert seq == greedy_reference(target, p, 20)
    assert out.sequences == local.sequences
    assert out.stats.row_steps == local.stats.row_steps
    assert out.stats.accepted_tokens == local.stats.accepted_tokens


def _reading_drafter(target: Any, draft: Any, kind: str) -> Any:
    """A drafter that reads the target's states, the same one at every call: a steered draft
    model (random map) or a SpecFormer head (random weights)."""
    if kind == "steered":
        steering = DraftSteering.for_models(target, draft)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in (steering.proj.weight, steering.proj.bias):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
        return ModelDrafter(draft, k=3, steering=steering)
    torch.manual_seed(0)
    return SpecFormerDrafter(SpecFormerHead.for_target(target, 3).eval(), target)


@pytest.mark.parametrize("kind", ["steered", "specformer"])
def test_drafters_that_read_the_target_get_its_states_through_the_workers(target, draft, kind):
    """The engine hands the target's states to the RemoteDrafter, which sends each worker its
    sequences' states: the drafts (hence the steps) of the same drafter in-process."""
    prompts = prompts_for(5, seed=3)
    local_drafter = _reading_drafter(target, draft, kind)
    local = SpeculativeDecoder(target, local_drafter).generate(prompts, max_new_tokens=16)
    if kind == "steered":  # the states matter: drafting without them accepts otherwise
        plain = SpeculativeDecoder(target, ModelDrafter(draft, k=3)).generate(
            prompts, max_new_tokens=16
        )
        assert plain.stats.accepted_tokens != local.stats.accepted_tokens
    workers = ThreadWorkers(
        _reading_drafter(target, draft, kind), _reading_drafter(target, draft, kind)
    )
    with RemoteDrafter(workers.connections) as drafter:
        assert drafter.target_hidden == local_drafter.target_hidden
        assert drafter.target_states == getattr(local_drafter, "target_states", "last")
        out = SpeculativeDecoder(target, drafter).generate(prompts, max_new_tokens=16)
        assert drafter.stats.sequences == [3, 2]
        assert drafter.stats.states_sent >= out.stats.row_steps
    assert out.sequences == local.sequences
    assert out.stats.row_steps == local.stats.row_steps
    assert out.stats.accepted_tokens == local.stats.accepted_tokens
    for p, seq in zip(prompts, out.sequences):
        assert seq == greedy_reference(target, p, 16)


def test_a_reading_worker_beside_others(target, draft):
    """A steered worker beside an n-gram one: only the steered one gets states; workers that
    read different states cannot share a server."""
    prompts = prompts_for(4, seed=4)
    workers = ThreadWorkers(
        _reading_drafter(target, draft, "steered"), CachebackDrafter(max_sequences=4)
    )
    with RemoteDrafter(workers.connections) as drafter:
        out = SpeculativeDecoder(target, drafter).generate(prompts, max_new_tokens=12)
        # Only the steered worker's two sequences (of four) get the target's states.
        assert 0 < drafter.stats.states_sent < out.stats.row_steps
    for p, seq in zip(prompts, out.sequences):
        assert seq == greedy_reference(target, p, 12)
    workers = ThreadWorkers(
        _reading_drafter(target, draft, "steered"), _reading_drafter(target, draft, "specformer")
    )
    with pytest.raises(ValueError, match="read different target states"):
        RemoteDrafter(workers.connections)
    assert workers.ended()


class StateRecorder(NoDrafter):
    """A drafter that reads target states 1 and 2 (256 wide) and keeps what it is handed."""

    target_hidden = (1, 2)
    target_hidden_size = 256

    def __init__(self) -> None:
        super().__init__()
        self.received: list[tuple[list[int], list[torch.Tensor]]] = []

    def steer(self, slots, hidden):
        self.received.append((list(slots), list(hidden)))


def test_target_states_cross_the_link_bit_for_bit_in_their_dtype():
    recorder = StateRecorder()
    workers = ThreadWorkers(recorder)
    g = torch.Generator().manual_seed(0)
    states = [torch.randn(2, 256, generator=g).bfloat16(), torch.randn(2, 256, generator=g)]
    with RemoteDrafter(workers.connections) as drafter:
        assert (drafter.target_hidden, drafter.target_hidden_size) == ((1, 2), 256)
        assert drafter.target_states == "last"
        drafter.start([0, 1], [[3, 4], [5]])
        sent = []
        for sending in (states, [states[0].float(), states[1]]):
            before = drafter.stats.bytes_sent
            drafter.steer([1, 0], sending)
            sent.append(drafter.stats.bytes_sent - before)
        drafter.propose([0, 1])  # answered after the one-way messages sent before it
        assert drafter.stats.states_sent == 4
    (slots, hidden), (_, widened) = recorder.received
    assert slots == [1, 0]
    assert hidden[0].dtype == torch.bfloat16 and torch.equal(hidden[0], states[0])
    assert hidden[1].dtype == torch.float32 and torch.equal(hidden[1], states[1])
    assert widened[0].dtype == torch.float32 and torch.equal(widened[0], states[0].float())
    assert sent[1] - sent[0] > 0.9 * 2 * 256 * 2  # a bfloat16 value: 2 bytes on the wire, not 4


def test_different_drafters_per_worker_and_placement(target, draft):
    """A tree-drafting device and an n-gram device (SLED's heterogeneous devices), each prompt
    placed by hand: lossless, and each sequence drafted where it was placed."""
    prompts = prompts_for(4, seed=2)
    prompts[3] = prompts[3] * 4  # repeats, so the n-gram worker has drafts
    tree = ModelDrafter(draft, mode="tree", k=3, branch=2, beam=2, max_nodes=8)
    workers = ThreadWorkers(tree, CachebackDrafter(max_nodes=8, max_depth=4, max_sequences=4))
    with RemoteDrafter(workers.connections, placement=[1, 0, 0, 1]) as drafter:
        assert not drafter.proposes_chains and drafter.max_nodes == 8
        assert drafter.max_sequences == 4
        out = SpeculativeDecoder(target, drafter).generate(prompts, max_new_tokens=16)
        assert drafter.stats.sequences == [2, 2]
        assert [i["name"] for i in drafter.infos] == ["ModelDrafter", "CachebackDrafter"]
    for p, seq in zip(prompts, out.sequences):
        assert seq == greedy_reference(target, p, 16)
    assert out.stats.accepted_tokens > 0


def test_sampled_and_deterministic_workers_in_one_batch(target, draft):
    """A sampling draft model beside an n-gram worker: the batch carries the draft model's
    distributions and marks the other rows deterministic; outputs repeat per seed."""
    prompts = prompts_for(4, seed=3)
    seen = []

    class Spy(RemoteDrafter):
        def propose(self, slots):
            tree = super().propose(slots)
            seen.append(tree)
            return tree

    def run() -> list[list[int]]:
        workers = ThreadWorkers(ModelDrafter(draft, k=3), CachebackDrafter(max_sequences=4))
        with Spy(workers.connections, placement=[0, 1, 0, 1]) as drafter:
            return generate(
                target, prompts, drafter=drafter, max_new_tokens=12, temperature=0.8, seed=5
            ).sequences

    first = run()
    assert isinstance(seen[0], SampledDraftTree)
    assert seen[0].draft_deterministic.tolist() == [False, True, False, True]
    assert seen[0].draft_probs.shape[-1] == V
    assert run() == first
    local = generate(
        target,
        [prompts[0]],
        drafter=ModelDrafter(draft, k=3),
        max_new_tokens=12,
        temperature=0.8,
        seed=5,
    )
    assert first[0] == local.sequences[0]  # the same seeded draws as in-process


def test_top_k_drafts_travel_as_their_exact_nonzeros(target, draft):
    """With top-k sampling the draft distributions are mostly zeros: the link carries their
    nonzeros only, bit-exact, and decoding is the same as with the drafter in-process."""
    g = torch.Generator().manual_seed(0)
    probs = torch.zeros(2, 4, 1000)
    for b, n in itertools.product(range(2), range(3)):  # node 3 is a leaf: a zero row
        picks = torch.randperm(1000, generator=g)[:3]
        probs[b, n, picks] = torch.softmax(torch.randn(3, generator=g), 0)
    tree = SampledDraftTree(
        torch.zeros(2, 4, dtype=torch.int32),
        torch.tensor([[-1, 0, 1, 2]] * 2, dtype=torch.int32),
        torch.full((2,), 4, dtype=torch.int32),
        probs,
    )
    message = _tree_message(tree)
    assert "draft_probs" not in message and "draft_probs_sparse" in message
    assert len(pickle.dumps(message)) < probs.numel() * 4 / 20
    back = _check_answer(0, pickle.loads(pickle.dumps(message)), 2)
    assert np.array_equal(back["draft_probs"], probs.numpy())  # bit for bit
    prompts = prompts_for(2, seed=8)
    kwargs = dict(max_new_tokens=12, temperature=0.9, top_k=3, seed=11)
    local = generate(target, prompts, drafter=ModelDrafter(draft, k=3), **kwargs)
    workers = ThreadWorkers(ModelDrafter(draft, k=3))
    with RemoteDrafter(workers.connections) as drafter:
        out = generate(target, prompts, drafter=drafter, **kwargs)
    assert out.sequences == local.sequences


def test_one_prompt_calls_take_turns_on_the_workers(target):
    workers = ThreadWorkers(NoDrafter(), NoDrafter(), NoDrafter())
    with RemoteDrafter(workers.connections) as drafter:
        for i in range(4):
            generate(target, [[1 + i, 2]], drafter=drafter, max_new_tokens=2)
        assert drafter.stats.sequences == [2, 1, 1]


# ---- stragglers and lost workers ----------------------------------------------------------------


class Slow:
    """A drafter whose every ``every``-th propose takes ``delay`` seconds."""

    def __init__(self, inner: Any, delay: float, every: int = 2) -> None:
        self.inner, self.delay, self.every, self.calls = inner, delay, every, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def propose(self, slots):
        self.calls += 1
        if self.calls % self.every == 0:
            time.sleep(self.delay)
        return self.inner.propose(slots)


def test_a_late_worker_is_skipped_at_the_deadline_and_decoding_stays_lossless(target, draft):
    prompts = prompts_for(4, seed=4)
    workers = ThreadWorkers(ModelDrafter(draft, k=3), Slow(ModelDrafter(draft, k=3), 0.4))
    with RemoteDrafter(workers.connections, deadline=0.1) as drafter:
        out = SpeculativeDecoder(target, drafter).generate(prompts, max_new_tokens=16)
        late = list(drafter.stats.late)
        # The next call starts while late answers may still be on the way: they are read and
        # dropped, never taken for the new sequences' drafts.
        again = SpeculativeDecoder(target, drafter).generate(prompts[::-1], max_new_tokens=16)
    assert late[0] == 0 and late[1] >= 2, late
    for p, seq in zip(prompts, out.sequences):
        assert seq == greedy_reference(target, p, 16)
    assert again.sequences == out.sequences[::-1]


class Vanishing:
    """A drafter whose worker goes away (its end of the pipe closed) at its ``at``-th propose."""

    def __init__(self, inner: Any, at: int) -> None:
        self.inner, self.at, self.calls, self.conn = inner, at, 0, None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def propose(self, slots):
        self.calls += 1
        if self.calls == self.at:
            self.conn.close()
            raise RuntimeError("device gone")
        return self.inner.propose(slots)


@pytest.mark.parametrize("drop_lost", [True, False])
def test_a_lost_worker_is_dropped_or_raises(target, draft, drop_lost):
    prompts = prompts_for(4, seed=6)
    gone = Vanishing(ModelDrafter(draft, k=3), at=3)
    workers = ThreadWorkers(ModelDrafter(draft, k=3), gone)
    gone.conn = workers.far_ends[1]
    with RemoteDrafter(workers.connections, drop_lost=drop_lost) as drafter:
        if not drop_lost:
            with pytest.raises(WorkerError, match="worker 1: connection lost"):
                SpeculativeDecoder(target, drafter).generate(prompts, max_new_tokens=16)
            # The failed call's sequences were closed: the slots are free again (and the
            # broken link still says so).
            with pytest.raises(WorkerError, match="connection lost"):
                drafter.start([0, 1], [[1, 2], [3, 4]])
            drafter.start([0], [[1, 2]])  # on the live worker
            assert drafter.propose([0]).num_nodes.tolist()[0] >= 1
            return
        out = SpeculativeDecoder(target, drafter).generate(prompts, max_new_tokens=16)
        assert drafter.stats.lost == [False, True]
    for p, seq in zip(prompts, out.sequences):
        assert seq == greedy_reference(target, p, 16)


# ---- errors -------------------------------------------------------------------------------------


class Failing:
    """A drafter that raises in one of its protocol calls."""

    def __init__(self, inner: Any, where: str) -> None:
        self.inner, self.where = inner, where

    def _maybe(self, name: str) -> None:
        if name == self.where:
            raise ValueError(f"broken {name}")

    def start(self, slots, prompts):
        self._maybe("start")
        self.inner.start(slots, prompts)

    def propose(self, slots):
        self._maybe("propose")
        return self.inner.propose(slots)

    def observe(self, slots, committed):
        self._maybe("observe")
        self.inner.observe(slots, committed)

    def release(self, slots):
        self.inner.release(slots)


@pytest.mark.parametrize("where", ["start", "observe", "propose"])
def test_a_workers_drafter_error_reaches_the_server(target, draft, where):
    workers = ThreadWorkers(Failing(ModelDrafter(draft, k=2), where))
    with RemoteDrafter(workers.connections) as drafter:
        with pytest.raises(WorkerError, match=f"worker 0: {where}: ValueError: broken {where}"):
            SpeculativeDecoder(target, drafter).generate(prompts_for(2), max_new_tokens=8)


class WrongRoot(NoDrafter):
    def propose(self, slots):
        tree = super().propose(slots)
        return ops.DraftTree(tree.tokens + 1, tree.parents, tree.num_nodes)


def test_a_worker_out_of_step_is_caught(target):
    workers = ThreadWorkers(WrongRoot())
    with RemoteDrafter(workers.connections) as drafter:
        with pytest.raises(WorkerError, match="out of step"):
            SpeculativeDecoder(target, drafter).generate([[5, 6, 7]], max_new_tokens=4)


def test_bad_arguments(draft):
    with pytest.raises(ValueError, match="at least one worker"):
        RemoteDrafter([])
    with pytest.raises(TypeError, match="workers\\[0\\]"):
        RemoteDrafter([object()])
    workers = ThreadWorkers(NoDrafter())
    with pytest.raises(ValueError, match="deadline"):
        RemoteDrafter(workers.connections, deadline=0)
    with pytest.raises(ValueError, match="placement"):
        RemoteDrafter(workers.connections, placement=[0, 1])
    other = tiny_transformer(seed=3, vocab_size=40, layers=1)
    workers = ThreadWorkers(ModelDrafter(draft), ModelDrafter(other))
    with pytest.raises(ValueError, match="vocabularies of \\[40, 61\\]"):
        RemoteDrafter(workers.connections)
    assert workers.ended()  # a refused set of workers is closed, not left hanging
    workers = ThreadWorkers(ModelDrafter(draft))
    with RemoteDrafter(workers.connections, placement=[0, 0]) as drafter:
        with pytest.raises(ValueError, match="not open"):
            drafter.propose([0])
        drafter.start([0], [[1, 2]])
        with pytest.raises(ValueError, match="already open"):
            drafter.start([0], [[1, 2]])
        with pytest.raises(ValueError, match="placement covers slots \\[0, 2\\)"):
            drafter.start([2], [[1, 2]])
        with pytest.raises(ValueError, match="empty"):
            drafter.start([1], [[]])
        with pytest.raises(ValueError, match="appears twice"):
            drafter.start([1, 1], [[1], [2]])
        with pytest.raises(ValueError, match="drafter's vocabulary \\[0, 61\\)"):
            drafter.start([1], [[61]])
        drafter.release([0])  # (the worker's draft model sized its cache for slot 0 alone)
        drafter.start([1], [[3]])  # checked before any worker heard of it: slot 1 is free
        with pytest.raises(ValueError, match="appears twice"):
            drafter.release([1, 1])
        with pytest.raises(ValueError, match="slot 0 is not open"):
            drafter.observe([1, 0], [[4], [5]])
        assert drafter.propose([1]).tokens[:, 0].tolist() == [3]  # neither released nor observed
    with pytest.raises(ValueError, match="authkey"):
        WorkerListener(("127.0.0.1", 0), b"short")
    with pytest.raises(TypeError, match="no start"):
        serve_drafter(None, object())


def test_a_full_set_of_workers_refuses_more_sequences(target, draft):
    workers = ThreadWorkers(CachebackDrafter(max_sequences=1), CachebackDrafter(max_sequences=2))
    with RemoteDrafter(workers.connections) as drafter:
        assert drafter.max_sequences == 3
        drafter.start([0, 1, 2], [[1], [2], [3]])
        assert drafter.stats.sequences == [1, 2]
        with pytest.raises(ValueError, match="full"):
            drafter.start([3], [[4]])


# ---- transports ---------------------------------------------------------------------------------


def test_workers_over_tcp_with_an_authkey(target, draft):
    key = b"edge-test-key-0123"
    with WorkerListener(("127.0.0.1", 0), key) as listener:
        served = []
        t = threading.Thread(
            target=lambda: served.append(
                connect_worker(listener.address, key, ModelDrafter(draft, k=3))
            ),
            daemon=True,
        )
        t.start()
        conns = listener.accept(1)
    prompts = prompts_for(3, seed=7)
    with RemoteDrafter(conns) as drafter:
        out = SpeculativeDecoder(target, drafter).generate(prompts, max_new_tokens=12)
    t.join(10)
    assert served and served[0] > 3
    for p, seq in zip(prompts, out.sequences):
        assert seq == greedy_reference(target, p, 12)


def test_a_worker_process_whose_drafter_cannot_be_made_says_why():
    workers = spawn_draft_workers(zoo_draft_model, 1, "no-such-pair")
    with pytest.raises(WorkerError, match="worker 0: factory: .*no-such-pair"):
        RemoteDrafter(workers)
    assert not workers[0].process.is_alive()


requires_pycode = pytest.mark.skipif(
    "pycode" not in zoo.available(), reason="the pycode weights are not installed"
)


@requires_pycode
def test_draft_model_workers_in_processes_on_the_shipped_pair():
    """Two worker processes, each loading the pair's draft model itself: the target's greedy
    text, with the drafts accepted as in-process."""
    target, draft, tok = zoo.load("pycode")
    prompts = [tok.encode(t, bos=True) for t in ("def fib(n):\n", "import os\n\n\ndef main(")]
    plain = generate(target, prompts, max_new_tokens=24)
    local = generate(target, prompts, drafter=ModelDrafter(draft, k=4), max_new_tokens=24)
    with RemoteDrafter(spawn_draft_workers(zoo_draft_model, 2, "pycode", 4)) as drafter:
        out = generate(target, prompts, drafter=drafter, max_new_tokens=24)
        assert drafter.stats.sequences == [1, 1]
    assert out.sequences == plain.sequences
    assert out.stats.accepted_tokens == local.stats.accepted_tokens > 0
