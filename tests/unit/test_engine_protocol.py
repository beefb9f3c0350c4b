"""The explorer's seams (rft_hpc.engines.protocol, rft_hpc.explorer.protocols): both
engines, the engine the multi-turn task threads share, both workflows and the reward pool
offer every member their protocol names, with the protocol's parameters."""

from __future__ import annotations

import inspect

import pytest

from rft_hpc.config.workflow import MultiTurnWorkflow, OverRolloutConfig
from rft_hpc.engines.hf import HFEngine
from rft_hpc.engines.protocol import StreamingEngine
from rft_hpc.engines.vllm import VLLMEngine
from rft_hpc.explorer.multiturn import SerialEngine, TurnSettings
from rft_hpc.explorer.overrollout import MultiTurnExplorer
from rft_hpc.explorer.protocols import Scorer, Workflow
from rft_hpc.explorer.step_stream import StepStream
from rft_hpc.explorer.workflow import SamplingSettings
from rft_hpc.tasks.reward_pool import RewardPool


def members(protocol: type) -> dict[str, object]:
    """The protocol's own members and those of the protocols it extends."""
    out: dict[str, object] = {}
    for cls in reversed(protocol.__mro__):
        if cls is object or not getattr(cls, "_is_protocol", False):
            continue
        out.update({k: v for k, v in vars(cls).items()
                    if not k.startswith("_") or k == "__len__"})
    return out


def takes_the_same_calls(own: object, declared: object) -> bool:
    """Whether `own` takes the parameters `declared` names (names and kinds, in order,
    after `self`), and any more only with a default."""
    mine, wanted = (list(inspect.signature(f).parameters.values())[1:]  # type: ignore[arg-type]
                    for f in (own, declared))
    return ([(p.name, p.kind) for p in mine[:len(wanted)]]
            == [(p.name, p.kind) for p in wanted]
            and all(p.default is not p.empty for p in mine[len(wanted):]))


@pytest.mark.parametrize(("cls", "protocol"), [
    (HFEngine, StreamingEngine), (VLLMEngine, StreamingEngine),
    (SerialEngine, StreamingEngine), (StepStream, Workflow),
    (MultiTurnExplorer, Workflow), (RewardPool, Scorer)])
def test_each_implementation_has_its_protocols_methods_with_their_parameters(cls, protocol):
    missing, different = [], []
    for name, member in members(protocol).items():
        if callable(member) and not isinstance(member, property):
            own = getattr(cls, name, None)
            if own is None:
                missing.append(name)
            elif not takes_the_same_calls(own, member):
                different.append(name)
    assert not missing and not different, (cls.__name__, missing, different)


def test_the_engines_and_workflows_pass_runtime_protocol_checks(tiny_model):
    engine = HFEngine(tiny_model)
    serial = SerialEngine(engine)
    # the turn batcher streams the trajectories' turns through it
    assert isinstance(engine, StreamingEngine) and isinstance(serial, StreamingEngine)
    assert serial.plain_tokens("1+2=") == engine.plain_tokens("1+2=")
    assert serial.context_limit() == engine.model.config.max_position_embeddings
    with RewardPool(workers=1) as pool:
        assert isinstance(pool, Scorer)
        stream = StepStream(engine, SamplingSettings(2, 2, 1.0), pool, window=2)
        assert isinstance(stream, Workflow) and stream.window == 2 and stream.has_room
    turns = MultiTurnExplorer(engine, MultiTurnWorkflow(), TurnSettings(2, 2, 1.0),
                              OverRolloutConfig())
    assert isinstance(turns, Workflow) and turns.window == 1 and len(turns) == 0
    assert isinstance(turns.engine, SerialEngine)
