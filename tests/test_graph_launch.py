"""The captured step's graph launch through the CUDA driver, with a stand-in driver on the CPU:
the driver launches while the graph's context is current, torch's replay otherwise, and where
the driver or the graph's exec handle is missing; a refused launch raises naming its code."""

from __future__ import annotations

import ctypes

import pytest

from blocktable.step import graph_launch


class FakeDriver:
    """``cuCtxGetCurrent`` reports ``self.context``; ``cuGraphLaunch`` records and returns
    ``self.result``."""

    def __init__(self, context: int = 0x1000, result: int = 0) -> None:
        self.context, self.result = context, result
        self.launched: list[tuple[int, int]] = []

    def cuCtxGetCurrent(self, ref: object) -> int:
        ctypes.cast(ref, ctypes.POINTER(ctypes.c_void_p))[0] = self.context or None
        return 0

    def cuGraphLaunch(self, handle: int, stream: int) -> int:
        self.launched.append((handle, stream))
        return self.result


class FakeGraph:
    def __init__(self, handle: int | None = 0xBEEF) -> None:
        self.handle, self.replays = handle, 0

    def raw_cuda_graph_exec(self) -> int:
        if self.handle is None:
            raise RuntimeError("not instantiated")
        return self.handle

    def replay(self) -> None:
        self.replays += 1


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> FakeDriver:
    fake = FakeDriver()
    monkeypatch.setattr(graph_launch, "_cuda_driver", lambda: fake)
    monkeypatch.setattr(graph_launch, "raw_stream_getter", lambda: lambda index: 0x500 + index)
    return fake


def test_launches_through_the_driver_on_the_current_stream(driver: FakeDriver) -> None:
    graph = FakeGraph()
    launch = graph_launch.graph_launcher(graph, 3)  # type: ignore[arg-type]
    launch()
    launch()
    assert driver.launched == [(0xBEEF, 0x503)] * 2
    assert graph.replays == 0


def test_replays_through_torch_when_another_context_is_current(driver: FakeDriver) -> None:
    graph = FakeGraph()
    launch = graph_launch.graph_launcher(graph, 0)  # type: ignore[arg-type]
    driver.context = 0x2000  # another device made current after the capture
    launch()
    assert graph.replays == 1 and driver.launched == []
    driver.context = 0x1000
    launch()
    assert graph.replays == 1 and len(driver.launched) == 1


def test_replays_through_torch_without_a_handle_a_context_or_a_driver(
        driver: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    graph = FakeGraph(handle=None)
    assert graph_launch.graph_launcher(graph, 0) == graph.replay  # type: ignore[arg-type]
    driver.context = 0  # no context current at the capture
    graph = FakeGraph()
    assert graph_launch.graph_launcher(graph, 0) == graph.replay  # type: ignore[arg-type]
    monkeypatch.setattr(graph_launch, "_cuda_driver", lambda: None)
    driver.context = 0x1000
    assert graph_launch.graph_launcher(graph, 0) == graph.replay  # type: ignore[arg-type]
    assert driver.launched == []


def test_a_refused_launch_raises_naming_the_driver_result(driver: FakeDriver) -> None:
    launch = graph_launch.graph_launcher(FakeGraph(), 0)  # type: ignore[arg-type]
    driver.result = 400  # CUDA_ERROR_INVALID_HANDLE
    with pytest.raises(RuntimeError, match="cuGraphLaunch failed.*400"):
        launch()


def test_no_driver_on_this_machine_is_none_not_an_error() -> None:
    lib = graph_launch._cuda_driver()
    assert lib is None or hasattr(lib, "cuGraphLaunch")
