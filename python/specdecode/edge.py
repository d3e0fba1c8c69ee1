"""Edge speculative decoding: drafters that run on other machines, verified in one batch.

In edge serving (SLED: Li et al., "SLED: A Speculative LLM Decoding Framework for Efficient Edge
Serving", 2025) each edge device runs a small draft model next to its user and a shared server
holds the target: the devices draft, the server verifies the drafts of all of them in one batched
forward pass and sends back what each sequence committed. Drafting moves off the server, which
spends its time on the one thing only it can do, and devices of different kinds may run
different drafters (any drafter of the :mod:`specdecode.drafters` protocol works on a device).
Decentralised speculative decoding (Song et al., 2025) rests on the same split: the party that
holds the target verifies many tokens per round trip, so the cost of the link is paid per round,
not per token.

Here the server side is :class:`RemoteDrafter`, a drafter for
:class:`~specdecode.engine.SpeculativeDecoder` whose drafts come from *draft workers* over
connections (:mod:`multiprocessing.connection`: a pipe to a local process, or TCP with an
authentication key); the device side is :func:`serve_drafter`, which runs the drafter protocol
on the device's own drafter. Each sequence drafts on one worker for its whole life; every step,
the workers draft at the same time and the server waits for all of them, or, with a
``deadline``, for those that answer in time: a late worker's sequences take a root-only tree
that step (the target's own token; decoding stays lossless, the late answer is dropped). With
``drop_lost=True`` a worker whose connection breaks is dropped the same way for good.

Wire format: each message is one :mod:`pickle` of plain Python and numpy values, so the link
carries no torch-specific sharing (a pipe or a socket to another machine alike). Pickle runs
code on load: connect only peers you trust, over links protected by ``authkey``
(:class:`WorkerListener` / :func:`connect_worker`). The server sends committed tokens, sampling
parameters and draft requests; a worker answers each draft request with its trees (and, for
sampled drafts, the distributions they were drawn from: ``[n, N, V]`` float32 per request, which
a chain of ``k`` tokens over a 32k vocabulary makes 0.6 MB per sequence and step, or their exact
nonzeros where that is smaller, as with top-k or top-p sampling).
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from multiprocessing import connection as mpc
from multiprocessing import get_context
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch

from .drafters import SampledDraftTree, _host_int32, _new_slots, _open_slots, _token_rows
from .ops import MAX_TREE_NODES, DraftTree

__all__ = [
    "DraftWorker",
    "EdgeStats",
    "RemoteDrafter",
    "WorkerError",
    "WorkerListener",
    "connect_worker",
    "serve_drafter",
    "spawn_draft_workers",
    "zoo_draft_model",
]

# Requests the worker answers (one reply each, in order); the others are one-way: an error in
# one is held and returned with the next reply, so a step costs one round trip.
_ANSWERED = ("hello", "propose", "close")
_ONE_WAY = ("start", "configure", "steer", "follow", "observe", "release")


class WorkerError(RuntimeError):
    """A draft worker failed: its drafter raised, it answered out of protocol, or (without
    ``drop_lost``) its connection broke."""


# ---- the wire ---------------------------------------------------------------------------------


def _send(conn: Any, message: Any) -> int:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    conn.send_bytes(data)
    return len(data)


def _receive(conn: Any) -> tuple[Any, int]:
    data = conn.recv_bytes()
    return pickle.loads(data), len(data)


def _plain(x: Any) -> Any:
    """A tensor as a numpy array (the wire carries no torch objects); anything else as is."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return x


def _tree_message(tree: Any) -> dict[str, Any]:
    """A drafter's proposal as the reply's dict of numpy arrays."""
    out = {
        "tokens": _host_int32(tree.tokens),
        "parents": _host_int32(tree.parents),
        "num_nodes": _host_int32(tree.num_nodes),
    }
    probs = getattr(tree, "draft_probs", None)
    if probs is not None:
        dense = np.ascontiguousarray(_plain(probs), dtype=np.float32)
        where = np.flatnonzero(dense)
        # Top-k / top-p drafts and leaf rows are mostly zeros; the exact nonzeros (8 bytes
        # each) are the smaller message below half density. Bit-exact either way: lossless
        # verification reads the very distribution the drafts were drawn from.
        if where.size * 2 < dense.size:
            out["draft_probs_sparse"] = (dense.shape, where, dense.ravel()[where])
        else:
            out["draft_probs"] = dense
        det = getattr(tree, "draft_deterministic", None)
        if det is not None:
            out["draft_deterministic"] = np.asarray(_plain(det), dtype=bool)
    return out


# ---- the device side -------------------------------------------------------------------------


def _state_array(h: torch.Tensor) -> tuple[str, np.ndarray]:
    """A target state for the wire, exactly: its dtype's name and its values as a numpy array
    (bfloat16, which numpy lacks, as its 16-bit patterns)."""
    h = h.detach().cpu()
    if h.dtype == torch.bfloat16:
        return "bfloat16", h.view(torch.int16).numpy()
    return str(h.dtype).removeprefix("torch."), h.numpy()


def _state_tensor(message: tuple[str, np.ndarray]) -> torch.Tensor:
    """:func:`_state_array`'s inverse."""
    dtype, values = message
    t = torch.from_numpy(np.ascontiguousarray(values))
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def _describe(drafter: Any) -> dict[str, Any]:
    """What the server needs to know of a worker's drafter (the ``hello`` reply)."""
    info: dict[str, Any] = {"name": type(drafter).__name__}
    for attr in ("vocab_size", "max_sequences", "max_nodes"):
        value = getattr(drafter, attr, None)
        info[attr] = None if value is None else int(value)
    info["proposes_chains"] = getattr(drafter, "proposes_chains", False) is True
    info["configurable"] = callable(getattr(drafter, "configure", None))
    # A drafter that reads the target (steered drafters, SpecFormer): which of its states.
    layers = getattr(drafter, "target_hidden", None)
    info["target_hidden"] = None if layers is None else [int(i) for i in layers]
    size = getattr(drafter, "target_hidden_size", None) if layers is not None else None
    info["target_hidden_size"] = None if size is None else int(size)
    info["target_states"] = str(getattr(drafter, "target_states", "last"))
    return info


def serve_drafter(conn: Any, drafter: Any) -> int:
    """Runs the drafter protocol on ``drafter`` for a :class:`RemoteDrafter` at the other end of
    ``conn`` (the device side), until the server says ``close`` or the connection ends.

    Parameters
    ----------
    conn : multiprocessing.connection.Connection
        A connection to the server (a pipe end, or :func:`connect_worker`'s).
    drafter : Drafter
        Any drafter of the :mod:`specdecode.drafters` protocol, with its own model on this device.

    Returns
    -------
    int
        How many requests it served.
    """
    for attr in ("start", "propose", "observe", "release"):
        if not callable(getattr(drafter, attr, None)):
            raise TypeError(f"drafter: expected a Drafter, it has no {attr}() method")
    return _serve(conn, drafter, None)


def _serve(conn: Any, drafter: Any, held: Optional[str]) -> int:
    """:func:`serve_drafter`'s loop; ``held``: an error to answer every request with (a worker
    whose drafter could not be made)."""
    served = 0
    while True:
        try:
            message, _ = _receive(conn)
        except (EOFError, OSError):
            return served
        served += 1
        op, number, payload = message
        if op in _ONE_WAY:
            if held is None:
                try:
                    if op == "start":
                        drafter.start(*payload)
                    elif op == "configure":
                        slots, sampling = payload
                        drafter.configure(slots, **sampling)
                    elif op == "steer":
                        slots, hidden = payload
                        drafter.steer(slots, [_state_tensor(h) for h in hidden])
                    elif op == "follow":
                        slots, hidden, lengths = payload
                        drafter.follow(slots, [_state_tensor(h) for h in hidden], lengths)
                    elif op == "observe":
                        drafter.observe(*payload)
                    else:
                        drafter.release(payload)
                except Exception as exc:  # reported to the server with the next reply
                    held = f"{op}: {type(exc).__name__}: {exc}"
            continue
        if op not in _ANSWERED:
            held = held or f"unknown request {op!r}"
        reply: tuple[Any, ...]
        if held is not None:
            reply = (number, "error", held)
        elif op == "hello":
            reply = (number, "ok", _describe(drafter))
        elif op == "propose":
            try:
                reply = (number, "ok", _tree_message(drafter.propose(payload)))
            except Exception as exc:
                held = f"propose: {type(exc).__name__}: {exc}"
                reply = (number, "error", held)
        else:  # close
            reply = (number, "ok", None)
        try:
            _send(conn, reply)
        except (EOFError, OSError):
            return served
        if op == "close":
            return served


def zoo_draft_model(name: str = "pycode", k: int = 4, mode: str = "chain", **options: Any) -> Any:
    """A zoo pair's draft model as a :class:`~specdecode.drafters.ModelDrafter` (a factory for
    :func:`spawn_draft_workers`: it runs in the worker, which loads the weights itself)."""
    from . import zoo
    from .drafters import ModelDrafter

    _, draft, _ = zoo.load(name)
    return ModelDrafter(draft, mode=mode, k=k, **options)


def _worker_main(conn: Any, factory: Callable[..., Any], args: tuple, threads: int) -> None:
    torch.set_num_threads(threads)
    try:
        drafter = factory(*args)
    except Exception as exc:  # the server's hello gets the reason instead of a silent EOF
        _serve(conn, None, f"factory: {type(exc).__name__}: {exc}")
        return
    serve_drafter(conn, drafter)


@dataclasses.dataclass
class DraftWorker:
    """A draft worker in a local process (:func:`spawn_draft_workers`): ``connection`` is the
    server's end of its pipe."""

    connection: Any
    process: Any

    def close(self, timeout: float = 10.0) -> None:
        """Waits for the process to end (after :meth:`RemoteDrafter.close`), else stops it."""
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout)
        self.connection.close()


def spawn_draft_workers(
    factory: Callable[..., Any], count: int, *args: Any, threads: int = 1
) -> list[DraftWorker]:
    """Starts ``count`` draft workers, each a fresh process (``spawn``) that builds its drafter
    with ``factory(*args)`` and serves it (a stand-in for edge devices on one machine).

    Parameters
    ----------
    factory : callable
        A module-level function (pickled by name), e.g. :func:`zoo_draft_model`.
    count : int
        Workers, ``>= 1``.
    *args
        ``factory``'s arguments (picklable).
    threads : int
        torch threads per worker.

    Returns
    -------
    list of DraftWorker
        Hand them to :class:`RemoteDrafter`, which closes them with itself.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count: expected an int >= 1, got {count!r}")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads: expected an int >= 1, got {threads!r}")
    ctx = get_context("spawn")
    workers = []
    for _ in range(count):
        server_end, worker_end = ctx.Pipe()
        process = ctx.Process(
            target=_worker_main, args=(worker_end, factory, args, threads), daemon=True
        )
        process.start()
        worker_end.close()
        workers.append(DraftWorker(server_end, process))
    return workers


class WorkerListener:
    """The server's side of TCP workers: listens on ``address`` for :func:`connect_worker`.

    Parameters
    ----------
    address : (str, int)
        Host and port to listen on (port 0: a free port, read back from :attr:`address`).
    authkey : bytes
        The shared secret a worker must prove it holds (HMAC challenge) before any message is
        read: at least 8 bytes, as the stream it guards is pickled.
    """

    def __init__(self, address: tuple[str, int], authkey: bytes) -> None:
        if not isinstance(authkey, bytes) or len(authkey) < 8:
            raise ValueError("authkey: expected bytes of length >= 8 (it guards a pickle stream)")
        self._listener = mpc.Listener(tuple(address), family="AF_INET", authkey=authkey)

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) it listens on."""
        return tuple(self._listener.address)

    def accept(self, count: int) -> list[Any]:
        """Waits for ``count`` workers to connect (blocking) and returns their connections, for
        :class:`RemoteDrafter`; a peer that fails the key check raises
        :class:`multiprocessing.AuthenticationError`."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count: expected an int >= 1, got {count!r}")
        return [self._listener.accept() for _ in range(count)]

    def close(self) -> None:
        self._listener.close()

    def __enter__(self) -> WorkerListener:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def connect_worker(
    address: tuple[str, int], authkey: bytes, drafter: Any, retry_for: float = 0.0
) -> int:
    """The device side over TCP: connects to a :class:`WorkerListener` at ``address`` and serves
    ``drafter`` until the server closes.

    Parameters
    ----------
    address : (str, int)
        The server's host and port.
    authkey : bytes
        The server's key.
    drafter : Drafter
        What this device drafts with.
    retry_for : float
        Seconds to keep retrying while the server refuses connections (not listening yet).

    Returns
    -------
    int
        :func:`serve_drafter`'s count of requests.
    """
    end = time.monotonic() + max(float(retry_for), 0.0)
    while True:
        try:
            conn = mpc.Client(tuple(address), family="AF_INET", authkey=authkey)
            break
        except ConnectionRefusedError:
            if time.monotonic() >= end:
                raise
            time.sleep(0.2)
    with conn:
        return serve_drafter(conn, drafter)


# ---- the server side --------------------------------------------------------------------------


@dataclasses.dataclass
class EdgeStats:
    """Per worker counts of a :class:`RemoteDrafter` (lists indexed by worker).

    Attributes
    ----------
    rounds : list of int
        Draft requests answered in time.
    late : list of int
        Steps whose drafts a worker did not deliver by the deadline, or was not asked for as
        it was still busy with a late request (its sequences took root-only trees).
    lost : list of bool
        Workers dropped after their connection broke (``drop_lost``).
    sequences : list of int
        Sequences opened on each worker.
    wait_time : float
        Seconds the server spent waiting for drafts (the devices' drafting as the server sees
        it, link included).
    bytes_sent, bytes_received : int
        Bytes of pickled messages over all links.
    states_sent : int
        Sequence-steps whose target states went to a worker (drafters that read the target).
    """

    rounds: list[int]
    late: list[int]
    lost: list[bool]
    sequences: list[int]
    wait_time: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    states_sent: int = 0


class _Link:
    """One worker's connection, with the numbering that pairs answers with requests."""

    def __init__(self, conn: Any, owner: Any = None) -> None:
        self.conn = conn
        self.owner = owner  # a DraftWorker to close with the link, or None
        self.number = 0  # the last request's number
        self.awaited: list[int] = []  # numbers of answered requests not yet read, in order
        self.lost = False


class RemoteDrafter:
    """A drafter whose drafts come from draft workers (edge devices) over connections.

    Each sequence is placed on one worker when it starts and drafts there until it is released;
    every step the workers draft their sequences at the same time and the trees are put together
    into one batch for the target (a :class:`~specdecode.drafters.SampledDraftTree` as soon as
    one worker sampled its drafts: the other workers' rows are then marked
    ``draft_deterministic``).

    Parameters
    ----------
    workers : sequence
        Connections to workers running :func:`serve_drafter` (pipe ends, the connections of
        :meth:`WorkerListener.accept`) or :class:`DraftWorker` objects. Their drafters must share
        one vocabulary.
    placement : sequence of int, optional
        ``placement[slot]``: the worker a slot's sequence drafts on (the engine's slots are the
        prompts' indices, so this says which device drafts which prompt). Default: the worker
        with the fewest open sequences that has room (among equals, the next one after the last
        placement).
    deadline : float, optional
        Seconds to wait for drafts per step; a worker that has not answered by then drafts
        nothing that step (its answer is dropped when it comes), nor in the steps until it has
        answered (it is not sent requests it could only answer late). Default: wait for every
        worker.
    drop_lost : bool
        With True, a worker whose connection breaks is dropped and its sequences take root-only
        trees from then on (decoding goes on, losslessly, at one token per step for them);
        with False (default) that raises :class:`WorkerError`.
    connect_timeout : float
        Seconds to wait for each worker's first answer (a spawned worker loads its model first).

    Attributes
    ----------
    stats : EdgeStats
    infos : list of dict
        Each worker's drafter as it described itself (``name``, ``vocab_size``,
        ``max_sequences``, ``max_nodes``, ``proposes_chains``).

    Notes
    -----
    Lossless like the workers' drafters: a tree the engine verifies is either a worker's own
    (made from exactly the committed tokens the server sent it: a tree whose root is not the
    sequence's last token raises) or the root alone. The server keeps each sequence's last
    committed token for root-only trees, so a late or lost worker never stalls the batch.
    Sampling parameters (``configure``) reach the workers' drafters that take them.
    """

    def __init__(
        self,
        workers: Sequence[Any],
        *,
        placement: Optional[Sequence[int]] = None,
        deadline: Optional[float] = None,
        drop_lost: bool = False,
        connect_timeout: float = 120.0,
    ) -> None:
        if len(workers) == 0:
            raise ValueError("workers: expected at least one worker")
        if deadline is not None and not (float(deadline) > 0 and np.isfinite(deadline)):
            raise ValueError(f"deadline: expected seconds > 0, got {deadline!r}")
        self._links = []
        for i, w in enumerate(workers):
            conn = w.connection if isinstance(w, DraftWorker) else w
            if not all(callable(getattr(conn, a, None)) for a in ("send_bytes", "recv_bytes")):
                raise TypeError(
                    f"workers[{i}]: expected a multiprocessing connection or a DraftWorker, "
                    f"got {type(w).__name__}"
                )
            self._links.append(_Link(conn, w if isinstance(w, DraftWorker) else None))
        self._placement = None if placement is None else [int(p) for p in placement]
        if self._placement is not None and any(
            not 0 <= p < len(self._links) for p in self._placement
        ):
            raise ValueError(f"placement: expected worker indices in [0, {len(self._links)})")
        self.deadline = None if deadline is None else float(deadline)
        self.drop_lost = bool(drop_lost)
        n = len(self._links)
        self.stats = EdgeStats([0] * n, [0] * n, [False] * n, [0] * n)
        self._worker: dict[int, int] = {}  # slot -> worker
        self._root: dict[int, int] = {}  # slot -> its last committed token
        self._next = 0  # where the next tie in placement starts
        self._closed = False
        try:
            self.infos = [self._call(i, "hello", None, connect_timeout) for i in range(n)]
        except BaseException:
            self.close()
            raise
        vocabs = {info["vocab_size"] for info in self.infos if info["vocab_size"] is not None}
        if len(vocabs) > 1:
            self.close()
            raise ValueError(
                f"workers: their drafters have vocabularies of {sorted(vocabs)} tokens; they must "
                "share the target's"
            )
        self._vocab = next(iter(vocabs), None)
        reads = {
            (tuple(info["target_hidden"]), info["target_hidden_size"], info["target_states"])
            for info in self.infos
            if info.get("target_hidden")
        }
        if len(reads) > 1:
            self.close()
            raise ValueError(
                f"workers: their drafters read different target states {sorted(reads)} (layers, "
                "size, kind); the server hands every worker the same ones"
            )
        self._reads: Optional[tuple[tuple[int, ...], Optional[int], str]] = next(iter(reads), None)

    # ---- what the engine reads -----------------------------------------------------------------

    @property
    def vocab_size(self) -> Optional[int]:
        return self._vocab

    @property
    def max_sequences(self) -> int:
        if self._placement is not None:
            return len(self._placement)
        return sum(self._capacity(i) for i in range(len(self._links)))

    @property
    def max_nodes(self) -> int:
        caps = [info["max_nodes"] for info in self.infos if info["max_nodes"] is not None]
        return max(caps, default=MAX_TREE_NODES)

    @property
    def proposes_chains(self) -> bool:
        return all(info["proposes_chains"] for info in self.infos)

    @property
    def target_hidden(self) -> Optional[tuple[int, ...]]:
        """The target's hidden-state indices the workers' drafters read (steered drafters,
        SpecFormer heads), or None: the engine then hands them over through :meth:`steer` or
        :meth:`follow`."""
        return None if self._reads is None else self._reads[0]

    @property
    def target_hidden_size(self) -> Optional[int]:
        return None if self._reads is None else self._reads[1]

    @property
    def target_states(self) -> str:
        """``"last"`` (the state at the last accepted node, :meth:`steer`) or ``"path"`` (the
        states along the accepted path, :meth:`follow`)."""
        return "last" if self._reads is None else self._reads[2]

    def _capacity(self, worker: int) -> int:
        cap = self.infos[worker]["max_sequences"]
        return 1 << 20 if cap is None else cap

    # ---- the link ------------------------------------------------------------------------------

    def _post(self, worker: int, op: str, payload: Any) -> bool:
        """Sends a request; False (and the worker dropped) when its connection is gone."""
        link = self._links[worker]
        if link.lost:
            return False
        link.number += 1
        try:
            self.stats.bytes_sent += _send(link.conn, (op, link.number, payload))
        except (EOFError, OSError) as exc:
            self._lose(worker, exc)
            return False
        if op in _ANSWERED:
            link.awaited.append(link.number)
        return True

    def _lose(self, worker: int, exc: BaseException) -> None:
        link = self._links[worker]
        if not self.drop_lost:
            raise WorkerError(f"worker {worker}: connection lost ({type(exc).__name__})") from exc
        link.lost = True
        self.stats.lost[worker] = True

    def _read(self, worker: int) -> Optional[tuple[int, Any]]:
        """The worker's next answer as (request number, result); None when the worker is lost.
        An error answer raises."""
        link = self._links[worker]
        try:
            (number, status, result), size = _receive(link.conn)
        except (EOFError, OSError) as exc:
            self._lose(worker, exc)
            return None
        self.stats.bytes_received += size
        if not link.awaited or number != link.awaited[0]:
            raise WorkerError(f"worker {worker}: an answer out of order (request {number})")
        link.awaited.pop(0)
        if status != "ok":
            raise WorkerError(f"worker {worker}: {result}")
        return number, result

    def _idle(self, worker: int) -> bool:
        """Whether the worker has answered every request (late answers that came are read and
        dropped, without waiting)."""
        link = self._links[worker]
        while link.awaited and not link.lost and link.conn.poll(0):
            self._read(worker)
        return not link.awaited

    def _drain(self, worker: int) -> None:
        """Reads (and drops) the answers to the worker's late requests, waiting for them."""
        while self._links[worker].awaited and not self._links[worker].lost:
            self._read(worker)

    def _call(self, worker: int, op: str, payload: Any, timeout: Optional[float]) -> Any:
        """A request and its answer (earlier answers still on the way are read and dropped)."""
        if not self._post(worker, op, payload):
            raise WorkerError(f"worker {worker}: connection lost")
        want = self._links[worker].number
        while True:
            if timeout is not None and not self._links[worker].conn.poll(timeout):
                raise WorkerError(f"worker {worker}: no answer to {op!r} within {timeout} s")
            got = self._read(worker)
            if got is None:
                raise WorkerError(f"worker {worker}: connection lost")
            if got[0] == want:
                return got[1]

    # ---- protocol ------------------------------------------------------------------------------

    def _place(self, slots: list[int]) -> list[int]:
        if self._placement is not None:
            if any(s >= len(self._placement) for s in slots):
                raise ValueError(
                    f"slots: placement covers slots [0, {len(self._placement)}), got {max(slots)}"
                )
            return [self._placement[s] for s in slots]
        load = [0] * len(self._links)
        for w in self._worker.values():
            load[w] += 1
        out = []
        for _ in slots:
            free = [
                i
                for i in range(len(self._links))
                if load[i] < self._capacity(i) and not self._links[i].lost
            ]
            if not free:
                raise ValueError("slots: every live worker is full (see max_sequences)")
            # Among equally loaded workers, the one after the last placement: one-prompt calls
            # take turns instead of all landing on worker 0.
            n = len(self._links)
            best = min(free, key=lambda i: (load[i], (i - self._next) % n))
            self._next = (best + 1) % n
            load[best] += 1
            out.append(best)
        return out

    def _by_worker(self, slots: Sequence[int]) -> dict[int, list[int]]:
        """Positions in ``slots`` (open, from _open_slots) per worker, in order."""
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(slots):
            groups.setdefault(self._worker[s], []).append(i)
        return groups

    def start(self, slots: Sequence[int], prompts: Sequence[Any]) -> None:
        """Places the sequences on workers and sends each worker its prompts."""
        slots_l, rows = _new_slots(slots, prompts, self._worker.__contains__, self._vocab)
        for s, w in zip(slots_l, self._place(slots_l)):
            self._worker[s] = w
            self.stats.sequences[w] += 1
        for s, row in zip(slots_l, rows):
            self._root[s] = int(row[-1])
        started: list[tuple[int, list[int]]] = []
        try:
            for w, idx in self._by_worker(slots_l).items():
                # Prompts may outgrow a pipe's buffer: a late answer still being written would
                # then block the worker while the server blocks on the prompts. Read it first.
                self._drain(w)
                mine = [slots_l[i] for i in idx]
                self._post(w, "start", (mine, [rows[i] for i in idx]))
                started.append((w, mine))
        except BaseException:  # the engine releases nothing whose start failed: undo it here
            for w, mine in started:
                try:
                    self._post(w, "release", mine)
                except WorkerError:
                    pass
            for s in slots_l:
                self._worker.pop(s, None)
                self._root.pop(s, None)
            raise

    def configure(self, slots: Sequence[int], **sampling: Any) -> None:
        """Hands the sequences' sampling parameters to the workers whose drafters take them."""
        slots_l = _open_slots(slots, self._worker.__contains__)
        for w, idx in self._by_worker(slots_l).items():
            if not self.infos[w]["configurable"]:
                continue
            part = {
                name: np.broadcast_to(np.asarray(_plain(v)), (len(slots_l),))[idx].tolist()
                for name, v in sampling.items()
            }
            self._post(w, "configure", ([slots_l[i] for i in idx], part))

    def steer(self, slots: Sequence[int], hidden: Sequence[torch.Tensor]) -> None:
        """Sends the target's states at each sequence's last accepted node to the workers whose
        drafters read them (no answer is awaited; as ``ModelDrafter.steer``: one floating
        ``[n, Ht]`` tensor per index of :attr:`target_hidden`). They travel in their own dtype,
        bit for bit."""
        self._hand_states("steer", slots, hidden, None)

    def follow(
        self, slots: Sequence[int], hidden: Sequence[torch.Tensor], lengths: Sequence[int]
    ) -> None:
        """Sends the target's states along each sequence's accepted path to the workers whose
        drafters follow them (as ``SpecFormerDrafter.follow``: one ``[n, P, Ht]`` tensor per
        index of :attr:`target_hidden`, ``lengths [n]``). They travel in their own dtype, bit
        for bit."""
        self._hand_states("follow", slots, hidden, lengths)

    def _hand_states(
        self,
        op: str,
        slots: Sequence[int],
        hidden: Sequence[torch.Tensor],
        lengths: Optional[Sequence[int]],
    ) -> None:
        slots_l = _open_slots(slots, self._worker.__contains__)
        # In the target's own dtype (a bfloat16 state is 2 bytes on the wire, not 4).
        arrays = [_state_array(h) for h in hidden]
        counts = None if lengths is None else [int(n) for n in lengths]
        for w, idx in self._by_worker(slots_l).items():
            if not self.infos[w].get("target_hidden"):
                continue  # this worker's drafter does not read the target
            rows = [(dtype, values[idx]) for dtype, values in arrays]
            payload: tuple[Any, ...] = ([slots_l[i] for i in idx], rows)
            if counts is not None:
                payload += ([counts[i] for i in idx],)
            if self._post(w, op, payload):
                self.stats.states_sent += len(idx)

    def observe(self, slots: Sequence[int], committed: Sequence[Any]) -> None:
        """Sends each worker its sequences' committed tokens (no answer is awaited)."""
        slots_l = _open_slots(slots, self._worker.__contains__)
        rows = _token_rows(committed, "committed", len(slots_l))
        for w, idx in self._by_worker(slots_l).items():
            self._post(w, "observe", ([slots_l[i] for i in idx], [rows[i] for i in idx]))
        for s, row in zip(slots_l, rows):
            if row.size:
                self._root[s] = int(row[-1])

    def release(self, slots: Sequence[int]) -> None:
        """Closes the slots on their workers."""
        # A slot twice or not open raises here, before anything changes.
        slots_l = _open_slots(slots, self._worker.__contains__)
        groups = self._by_worker(slots_l)
        try:
            for w, idx in groups.items():
                self._post(w, "release", [slots_l[i] for i in idx])
        finally:  # closed here even when a link broke on the way
            for s in slots_l:
                self._worker.pop(s, None)
                self._root.pop(s, None)

    def propose(self, slots: Sequence[int]) -> Union[DraftTree, SampledDraftTree]:
        """Asks every worker for its sequences' trees at once and puts them together.

        Returns
        -------
        DraftTree or SampledDraftTree
            int32 ``tokens`` / ``parents`` ``[B, N]``, ``num_nodes`` ``[B]`` (``N`` the widest
            worker's), in the order of ``slots``; root-only rows for late or lost workers. With
            a worker's sampled drafts: float32 ``draft_probs`` ``[B, N, V]`` and bool
            ``draft_deterministic`` ``[B]``.
        """
        slots_l = _open_slots(slots, self._worker.__contains__)
        groups = self._by_worker(slots_l)
        asked = {}  # worker -> (request number, rows asked for)
        for w, idx in groups.items():
            if not self._idle(w):
                # Still drafting a late request: asking again would queue requests it can
                # only answer late. Its sequences take root-only trees until it is done.
                self.stats.late[w] += 1
                continue
            if self._post(w, "propose", [slots_l[i] for i in idx]):
                asked[w] = (self._links[w].number, len(idx))
        t0 = time.perf_counter()
        answers = self._collect(asked)
        self.stats.wait_time += time.perf_counter() - t0
        roots = np.array([self._root[s] for s in slots_l], dtype=np.int32)
        parts = [(np.asarray(groups[w], dtype=np.int64), answers[w]) for w in answers]
        return _merge_trees(roots, parts)

    def _collect(self, asked: dict[int, tuple[int, int]]) -> dict[int, dict[str, Any]]:
        """The answers that come in time to the draft requests ``asked[worker]`` (its number,
        and the rows it asked for)."""
        end = None if self.deadline is None else time.perf_counter() + self.deadline
        waiting = {self._links[w].conn: w for w in asked}
        answers: dict[int, dict[str, Any]] = {}
        while waiting:
            left = None if end is None else max(end - time.perf_counter(), 0.0)
            ready = mpc.wait(list(waiting), timeout=left)
            if not ready:
                break
            for conn in ready:
                w = waiting[conn]
                got = self._read(w)
                if got is None:
                    del waiting[conn]
                elif got[0] == asked[w][0]:
                    answers[w] = _check_answer(w, got[1], asked[w][1])
                    del waiting[conn]
                # else: an answer to an earlier, late request: dropped
        for w in waiting.values():
            self.stats.late[w] += 1
        for w in answers:
            self.stats.rounds[w] += 1
        return answers

    def close(self) -> None:
        """Tells the workers to stop and closes the links (and the processes it was given)."""
        if self._closed:
            return
        self._closed = True
        for link in self._links:
            if not link.lost:
                try:
                    _send(link.conn, ("close", link.number + 1, None))
                except (EOFError, OSError):
                    pass
            if link.owner is not None:
                link.owner.close()
            else:
                link.conn.close()

    def __enter__(self) -> RemoteDrafter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _check_answer(worker: int, answer: Any, rows: int) -> dict[str, np.ndarray]:
    """A worker's trees, checked for shape (the engine checks the trees themselves)."""
    if not isinstance(answer, dict) or not {"tokens", "parents", "num_nodes"} <= set(answer):
        raise WorkerError(f"worker {worker}: a draft answer without tokens/parents/num_nodes")
    tokens, parents, num = answer["tokens"], answer["parents"], answer["num_nodes"]
    if tokens.ndim != 2 or tokens.shape[0] != rows or parents.shape != tokens.shape:
        raise WorkerError(
            f"worker {worker}: trees of shape {list(tokens.shape)} for {rows} sequences"
        )
    if num.shape != (rows,) or (rows and (num.min() < 1 or num.max() > tokens.shape[1])):
        raise WorkerError(f"worker {worker}: num_nodes outside [1, {tokens.shape[1]}]")
    if "draft_probs_sparse" in answer:
        answer["draft_probs"] = _dense_probs(worker, *answer.pop("draft_probs_sparse"))
    probs = answer.get("draft_probs")
    if probs is not None and (probs.ndim != 3 or probs.shape[:2] != tokens.shape):
        raise WorkerError(
            f"worker {worker}: draft_probs of shape {list(probs.shape)} for trees of "
            f"{list(tokens.shape)}"
        )
    return answer


def _dense_probs(worker: int, shape: Any, where: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``draft_probs`` from their nonzeros (flat indices into ``shape``, float32 values)."""
    shape = tuple(int(x) for x in shape)
    size = int(np.prod(shape)) if len(shape) == 3 else 0
    if size == 0 or where.shape != values.shape or (where.size and not 0 <= where.min()):
        raise WorkerError(f"worker {worker}: malformed sparse draft_probs")
    if where.size and where.max() >= size:
        raise WorkerError(f"worker {worker}: sparse draft_probs index outside {list(shape)}")
    dense = np.zeros(size, dtype=np.float32)
    dense[where] = values
    return dense.reshape(shape)


def _merge_trees(
    roots: np.ndarray, parts: Sequence[tuple[np.ndarray, dict[str, np.ndarray]]]
) -> Union[DraftTree, SampledDraftTree]:
    """One batch from the workers' trees: ``parts`` are (rows of the batch, trees of those
    rows); rows no part covers are root-only trees on ``roots`` ``[B]``."""
    batch = roots.shape[0]
    width = max([1] + [int(a["tokens"].shape[1]) for _, a in parts])
    tokens = np.full((batch, width), -1, dtype=np.int32)
    parents = np.full((batch, width), -1, dtype=np.int32)
    num_nodes = np.ones(batch, dtype=np.int32)
    tokens[:, 0] = roots
    sampled = [(rows, a) for rows, a in parts if "draft_probs" in a]
    for rows, a in parts:
        w = a["tokens"].shape[1]
        if not np.array_equal(a["tokens"][:, 0], roots[rows]):
            bad = int(np.flatnonzero(a["tokens"][:, 0] != roots[rows])[0])
            raise WorkerError(
                f"a worker drafted from root {int(a['tokens'][bad, 0])} for a sequence whose "
                f"last committed token is {int(roots[rows[bad]])}: its state is out of step"
            )
        tokens[rows, :w] = a["tokens"]
        parents[rows, :w] = a["parents"]
        num_nodes[rows] = a["num_nodes"]
    trees = (torch.from_numpy(tokens), torch.from_numpy(parents), torch.from_numpy(num_nodes))
    if not sampled:
        return DraftTree(*trees)
    vocab = {int(a["draft_probs"].shape[2]) for _, a in sampled}
    if len(vocab) > 1:
        raise WorkerError(f"workers sampled over vocabularies of {sorted(vocab)} tokens")
    probs = torch.zeros((batch, width, vocab.pop()), dtype=torch.float32)
    deterministic = np.ones(batch, dtype=bool)
    for rows, a in sampled:
        w = a["tokens"].shape[1]
        idx = torch.from_numpy(rows)
        probs[idx, :w] = torch.from_numpy(a["draft_probs"])
        det = a.get("draft_deterministic")
        deterministic[rows] = False if det is None else det
    return SampledDraftTree(*trees, probs, torch.from_numpy(deterministic))
