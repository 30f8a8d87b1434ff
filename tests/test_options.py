"""open_engine's option objects (TransportOptions, PollerOptions, SameHostOptions, GpuOptions):
the same engine as the keywords of the same names, checked the same way, frozen, and never
mixed with a keyword of one of their fields."""

from __future__ import annotations

import dataclasses

import pytest

import aiote

pytestmark = pytest.mark.anyio

GROUPS = (
    ("transport", aiote.TransportOptions),
    ("poller", aiote.PollerOptions),
    ("local", aiote.SameHostOptions),
    ("gpu", aiote.GpuOptions),
)


def test_every_grouped_field_is_a_keyword_of_open_engine_with_the_same_default() -> None:
    import inspect

    params = inspect.signature(aiote.open_engine).parameters
    seen: set[str] = set()
    for name, cls in GROUPS:
        assert name in params
        for f in dataclasses.fields(cls):
            assert f.name in params, f"{cls.__name__}.{f.name} is no keyword of open_engine"
            assert f.name not in seen, f"{f.name} in two option objects"
            seen.add(f.name)
    # retry= and observe= take objects of their own (RetryPolicy, Observability)
    own = {"provider", "nics", "retry", "observe"}
    grouped = {p for p in params if p not in own and p not in dict(GROUPS)}
    assert grouped == seen, "a keyword of open_engine belongs to no option object"


def test_option_objects_are_frozen_and_keyword_only() -> None:
    t = aiote.TransportOptions(streams=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.streams = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        aiote.PollerOptions(10.0)  # type: ignore[misc]
    assert aiote.SameHostOptions() == aiote.SameHostOptions(same_host="shm")


async def test_an_option_object_opens_the_engine_its_keywords_open() -> None:
    opts = {
        "transport": aiote.TransportOptions(streams=3, max_peers=7),
        "poller": aiote.PollerOptions(pollers=1),
        "local": aiote.SameHostOptions(same_host=None),
    }
    async with aiote.open_engine(**opts) as a, aiote.open_engine(
        streams=3, max_peers=7, pollers=1, same_host=None
    ) as b:
        for e in (a, b):
            assert len(e.rails) == 3 and e.domains.streams == 3
            assert e.stats()["pollers"] == 1
            assert all(r.provider != "shm" for r in e.rails)


async def test_a_field_given_both_ways_is_an_invalid_argument() -> None:
    with pytest.raises(aiote.InvalidArgument, match="streams"):
        async with aiote.open_engine(transport=aiote.TransportOptions(), streams=1):
            pass
    with pytest.raises(aiote.InvalidArgument, match="spin_us"):
        async with aiote.open_engine(poller=aiote.PollerOptions(spin_us=0), spin_us=0):
            pass
    # a keyword of another group mixes fine
    async with aiote.open_engine(poller=aiote.PollerOptions(spin_us=0), same_host=None) as e:
        assert not e.closed


@pytest.mark.parametrize(("name", "cls"), GROUPS)
async def test_an_option_object_of_the_wrong_type_is_an_invalid_argument(name: str, cls: type) -> None:
    with pytest.raises(aiote.InvalidArgument, match=cls.__name__):
        async with aiote.open_engine(**{name: object()}):
            pass


@pytest.mark.parametrize(
    ("name", "opts", "match"),
    [
        ("transport", aiote.TransportOptions(streams=0), "streams"),
        ("transport", aiote.TransportOptions(message_slots=0), "message_slots"),
        ("poller", aiote.PollerOptions(spin_us=-1), "spin_us"),
        ("poller", aiote.PollerOptions(pollers=99), "pollers"),
        ("local", aiote.SameHostOptions(same_host=""), "same_host"),
        ("gpu", aiote.GpuOptions(gpu_backend="nosuch"), "gpu_backend"),
        ("gpu", aiote.GpuOptions(stage_chunk=1), "stage_chunk"),
        ("gpu", aiote.GpuOptions(ipc_streams=0), "ipc_streams"),
        ("gpu", aiote.GpuOptions(ipc_streams=17), "ipc_streams"),
    ],
)
async def test_an_option_object_is_checked_as_its_keywords(name: str, opts: object, match: str) -> None:
    with pytest.raises(aiote.InvalidArgument, match=match):
        async with aiote.open_engine(**{name: opts}):
            pass
