"""The autopilot patch as the API process sees it: its declaration and the name of its
scheduler class (API process; the class runs in EngineCore: autopilot_scheduler.py).

The engine hands vLLM `SCHEDULER_CLASS` (`scheduler_cls`), which vLLM's EngineCore imports.
Both live here rather than in autopilot_scheduler.py because that module imports vLLM as it
loads (its class subclasses vLLM's Scheduler), and the registry, which the API process and
`make check-vllm` import, must not.
"""

from server.vllm_plugins import patching
from server.vllm_plugins.vllm_source import Hook

SCHEDULER_CLASS = "server.vllm_plugins.autopilot_scheduler.AutopilotScheduler"

AUTOPILOT = patching.Patch(
    "autopilot",
    "the autopilot choosing K per step (otherwise vLLM's fixed K and batch cut-off)",
    (
        Hook(
            "vllm.v1.core.sched.scheduler",
            "Scheduler",
            members=(
                "schedule",
                "update_from_output",
                "update_draft_token_ids",
                "num_spec_tokens",
                "requests",
                "running",
                "waiting",
                "policy",
                "max_num_running_reqs",
                "_preempt_request",
                "block_size",
                "kv_cache_manager",
            ),
        ),
        Hook("vllm.v1.core.kv_cache_manager", "KVCacheManager", members=("coordinator",)),
        Hook("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator.get_blocks", ("request_id",)),
        Hook("vllm.v1.core.kv_cache_utils", "KVCacheBlock", members=("block_id",)),
        Hook(
            "vllm.v1.core.sched.output",
            "SchedulerOutput",
            members=(
                "num_spec_tokens_to_schedule",
                "num_scheduled_tokens",
                "scheduled_spec_decode_tokens",
            ),
        ),
        Hook(
            "vllm.v1.request",
            "Request",
            members=(
                "num_computed_tokens",
                "sampling_params",
                "spec_token_ids",
                "max_tokens",
                "num_output_tokens",
                "num_prompt_tokens",
                "priority",
                "arrival_time",
                "status",
            ),
        ),
        Hook(
            "vllm.v1.core.sched.request_queue",
            "SchedulingPolicy",
            members=("PRIORITY",),
        ),
        Hook(
            "vllm.v1.outputs",
            "ModelRunnerOutput",
            members=("sampled_token_ids", "req_id_to_index"),
        ),
    ),
)
