"""aiote.weights as a vLLM weight-transfer backend: a thin wrapper whose phases map one to one
onto vLLM's ``WeightTransferEngine`` (init / start update / receive / finish, infos as plain
dicts), and the trainer side's ``trainer_init`` / ``send_weights``. vLLM is not needed: when
it is importable the backend registers itself under the name "aiote"; either way this file
runs standalone, with 2 trainer ranks and 2 inference ranks (TP 2, fused qkv, float32 ->
float16) in one process, and verifies every inference shard.

    python examples/weights_vllm_backend.py              # asyncio
    python examples/weights_vllm_backend.py --backend trio

vLLM's workers are synchronous, so each side runs its aiote engine on an event loop thread of
its own (an anyio blocking portal) and the phase methods are plain blocking calls.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import anyio
import anyio.from_thread
import numpy as np

import aiote
from aiote import weights as W


class _Loop:
    """An aiote engine on its own event-loop thread; ``call`` runs a coroutine there."""

    def __init__(self, backend: str) -> None:
        self._stack = contextlib.ExitStack()
        self.portal = self._stack.enter_context(anyio.from_thread.start_blocking_portal(backend))
        self.engine: aiote.Engine = self._stack.enter_context(
            self.portal.wrap_async_context_manager(aiote.open_engine())
        )

    def call(self, fn: Any, *args: Any) -> Any:
        return self.portal.call(fn, *args)

    def close(self) -> None:
        self._stack.close()


class AioteWeightTransferEngine:
    """Worker (inference rank) side, vLLM's ``WeightTransferEngine`` shape."""

    def __init__(
        self,
        config: Mapping[str, Any],
        vllm_config: Any = None,
        device: Any = None,
        model: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        self.config = dict(config)
        self.model = dict(model or {})  # name -> the engine's parameter (a view into one region)
        self.loop = _Loop(self.config.get("backend", "asyncio"))
        self.rx: W.WeightReceiver | None = None
        self.mem: W.TargetRegion | None = None

    def init_transfer_engine(self, init_info: Mapping[str, Any]) -> dict[str, Any]:
        """Lays out this rank's parameters in one region (the engine's host arena), registers
        it once, and returns its target metadata (plain dict) for the controller's plan."""
        sources = [W.SourceShard(*s) for s in init_info["sources"]]
        specs = [(n, d, [W.Piece(p[0], tuple(p[1])) for p in pieces]) for n, d, pieces in init_info["specs"]]
        self.mem = self.loop.call(W.register_targets, self.loop.engine, init_info["rank"], specs, sources)
        return {"targets": W.ReceiverPlan(init_info["rank"], 0, (), 0, tuple(self.mem.targets)).to_json()}

    def start_weight_update(self) -> None:
        """vLLM pauses generation here; nothing to do for the transfer (the memory is registered)."""

    def receive_weights(self, update_info: Mapping[str, Any]) -> None:
        """Waits (with a deadline) until every byte of ``update_info["version"]`` is in place."""
        if "plan" in update_info:  # first update, or after a re-plan
            self.rx = W.WeightReceiver(self.loop.engine, W.ReceiverPlan.from_json(update_info["plan"]))
        assert self.rx is not None, "receive_weights before a plan"
        v, t = update_info["version"], update_info.get("timeout", 60.0)
        self.loop.call(lambda: self.rx.wait_version(v, timeout=t))  # type: ignore[union-attr]

    def finish_weight_update(self) -> None:
        """The bytes are in the engine's own parameters already: expose them (views)."""
        assert self.mem is not None
        for t in self.mem.targets:
            self.model[t.name] = self.mem.view(t.name)

    def shutdown(self) -> None:
        self.loop.close()


class AioteTrainerEngine:
    """Trainer side: ``trainer_init`` then ``send_weights`` per version."""

    def __init__(self, backend: str) -> None:
        self.loop = _Loop(backend)
        self.tx: W.WeightSender | None = None

    def trainer_init(self, plan_part: str, max_tmp_bytes: int = 64 << 20) -> None:
        self.tx = W.WeightSender(
            self.loop.engine, W.SenderPlan.from_json(plan_part), max_tmp_bytes=max_tmp_bytes
        )

    def send_weights(self, named_tensors: Iterator[tuple[str, np.ndarray]], version: int) -> W.PushStats:
        assert self.tx is not None, "send_weights before trainer_init"
        tensors = dict(named_tensors)
        tx = self.tx
        return self.loop.call(lambda: tx.push(tensors, version=version, timeout=60))  # type: ignore[no-any-return]

    def shutdown(self) -> None:
        if self.tx is not None:
            self.loop.call(self.tx.aclose)
        self.loop.close()


def _register_with_vllm() -> bool:
    """Registers the backend with vLLM's factory when vLLM is installed; False otherwise."""
    try:
        from vllm.distributed.weight_transfer import WeightTransferEngineFactory  # type: ignore[import-not-found]
    except Exception:  # vLLM absent (or another version): the wrapper still runs standalone
        return False
    WeightTransferEngineFactory.register_engine("aiote", __name__, "AioteWeightTransferEngine")
    return True


def main(backend: str) -> None:
    hidden, trainers, tp = 64, 2, 2
    shapes = {"q": (128, hidden), "k": (32, hidden), "v": (32, hidden), "up": (256, hidden)}
    sources = [
        W.SourceShard(n, s, "float32", t, W.split_rows(s[0], trainers, t))
        for n, s in shapes.items()
        for t in range(trainers)
    ]
    src_rows = [[s.name, list(s.shape), s.dtype, s.rank, list(s.rows)] for s in sources]
    workers, infos = [], []
    for r in range(tp):  # inference ranks: qkv fused, float16
        specs = [
            (
                "qkv",
                "float16",
                [[p.source, list(p.rows)] for p in W.fused_tp([("q", 128), ("k", 32), ("v", 32)], r, tp)],
            ),
            ("up", "float16", [["up", list(W.split_rows(256, tp, r))]]),
        ]
        w = AioteWeightTransferEngine({"backend": backend})
        infos.append(w.init_transfer_engine({"rank": r, "sources": src_rows, "specs": specs}))
        workers.append(w)
    targets = [t for info in infos for t in W.ReceiverPlan.from_json(info["targets"]).targets]
    plan = W.plan(sources, targets)  # the controller: pure, no I/O
    print(plan.validate(link_bytes_per_s=10e9))
    trainer_engines = [AioteTrainerEngine(backend) for _ in range(trainers)]
    for t, te in enumerate(trainer_engines):
        te.trainer_init(plan.sender(t).to_json())
    rng = np.random.default_rng(0)
    try:
        for version in (1, 2):
            full = {n: rng.standard_normal(s, dtype=np.float32) for n, s in shapes.items()}
            for w in workers:
                w.start_weight_update()
            for t, te in enumerate(trainer_engines):  # each trainer's own rows
                mine = (
                    (s.name, np.ascontiguousarray(full[s.name][s.rows[0] : s.rows[1]]))
                    for s in sources
                    if s.rank == t
                )
                te.send_weights(mine, version)
            for r, w in enumerate(workers):
                w.receive_weights(
                    {
                        "version": version,
                        "timeout": 30,
                        **({"plan": plan.receiver(r).to_json()} if version == 1 else {}),
                    }
                )
                w.finish_weight_update()
                q, k, v = (W.split_rows(shapes[n][0], tp, r) for n in "qkv")
                want = np.concatenate(
                    [full["q"][q[0] : q[1]], full["k"][k[0] : k[1]], full["v"][v[0] : v[1]]]
                )
                assert np.array_equal(w.model["qkv"], want.astype(np.float16))
                u = W.split_rows(256, tp, r)
                assert np.array_equal(w.model["up"], full["up"][u[0] : u[1]].astype(np.float16))
            print(f"version {version}: every inference shard verified ({backend})")
    finally:
        for te in trainer_engines:
            te.shutdown()
        for w in workers:
            w.shutdown()
    print("registered with vLLM" if _register_with_vllm() else "vLLM not installed: ran standalone")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    main(ap.parse_args().backend)
