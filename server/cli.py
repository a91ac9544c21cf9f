"""The command line: `specserve serve`, `specserve models pull|list`.

Flags override `SPECSERVE_*` environment variables, which override defaults;
all three land in one `Settings`. Configuration errors print one line and exit
with status 2, never a traceback.
"""

import argparse
import logging
import sys
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from server.config import ConfigError, Settings
from server.logs import configure_logging, configure_root_logging, route_output_as_json
from server.weights.embedded import ModelPullError

if TYPE_CHECKING:
    import socket

    from server.engine.contract import Engine
    from server.traffic.api_keys import ApiKeys

logger = logging.getLogger(__name__)

# Flags of `serve`, each a Settings field of the same name (docs/configuration.md lists them).
SERVE_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--host", {}),
    ("--port", {"type": int}),
    ("--metrics-port", {"type": int}),
    ("--model", {}),
    ("--draft-model", {}),
    ("--quantization", {"choices": ["auto", "none", "int8", "int4", "fp8"]}),
    ("--draft-quantization", {"choices": ["auto", "none", "int8", "fp8"]}),
    ("--draft-vocab", {}),
    ("--speculation", {"choices": ["auto", "fixed"]}),
    ("--speculative-method", {"choices": ["hybrid", "draft_model", "ngram"]}),
    ("--lookup-max-tokens", {"type": int}),
    ("--lookup-index-tokens", {"type": int}),
    ("--num-speculative-tokens", {"type": int}),
    ("--speculation-max-batch-size", {"type": int}),
    ("--no-speculation", {"action": "store_true"}),
    ("--gpu-engine-patches", {"action": "store_true"}),
    ("--speculation-trace", {}),
    ("--served-model-name", {}),
    ("--tool-call-parser", {}),
    ("--max-model-len", {"type": int}),
    ("--dtype", {"choices": ["bfloat16", "float32", "auto"]}),
    ("--seed", {"type": int}),
    ("--cache-dir", {}),
    ("--kv-cache-gib", {"type": int}),
    ("--max-num-seqs", {"type": int}),
    ("--block-size", {"type": int}),
    ("--enforce-eager", {"action": "store_true"}),
    ("--no-prefix-caching", {"action": "store_true"}),
    ("--shared-prefix-cache", {"action": "store_true"}),
    ("--tensor-parallel-size", {"type": int}),
    ("--pipeline-parallel-size", {"type": int}),
    ("--distributed-executor-backend", {"choices": ["mp", "ray"]}),
    ("--ray-nodes", {"type": int}),
    ("--ray-join-timeout-seconds", {"type": float}),
    ("--baseline-tpot-seconds", {"type": float}),
    ("--api-key-file", {}),
    ("--allow-unauthenticated", {"action": "store_true"}),
    ("--metrics-need-key", {"action": "store_true"}),
    ("--public-docs", {"action": "store_true"}),
    ("--rate-limit-store", {}),
    ("--rate-limit-on-store-failure", {"choices": ["open", "closed"]}),
    ("--max-body-bytes", {"type": int}),
    ("--max-concurrent-body-reads", {"type": int}),
    ("--body-read-timeout-seconds", {"type": float}),
    ("--max-connections", {"type": int}),
    ("--keep-alive-timeout-seconds", {"type": int}),
    ("--max-n", {"type": int}),
    ("--max-logprobs", {"type": int}),
    ("--max-stop-sequences", {"type": int}),
    ("--max-stop-length", {"type": int}),
    ("--max-tools", {"type": int}),
    ("--max-logit-bias", {"type": int}),
    ("--max-completion-sequences", {"type": int}),
    ("--max-json-schema-bytes", {"type": int}),
    ("--max-json-schema-depth", {"type": int}),
    ("--max-json-schema-items", {"type": int}),
    ("--max-grammar-symbols", {"type": int}),
    ("--max-concurrent-requests", {"type": int}),
    ("--max-queued-requests", {"type": int}),
    ("--queue-timeout-seconds", {"type": float}),
    ("--max-queued-per-tenant", {"type": int}),
    ("--max-concurrent-renders", {"type": int}),
    ("--request-timeout-seconds", {"type": float}),
    ("--drain-timeout-seconds", {"type": float}),
    ("--log-format", {"choices": ["text", "json"]}),
]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="start the OpenAI-compatible server")
    for flag, options in SERVE_FLAGS:
        field = flag.removeprefix("--").replace("-", "_")
        help_text = Settings.model_fields[field].description
        # SUPPRESS keeps unset flags out of the namespace so env values apply.
        serve.add_argument(flag, default=argparse.SUPPRESS, help=help_text, **options)
    models = commands.add_parser("models", help="manage the embedded default model pair")
    models_commands = models.add_subparsers(dest="models_command", required=True)
    for name, help_text in (
        ("pull", "download, verify and convert the pair"),
        ("list", "show the pair and whether it is cached"),
    ):
        sub = models_commands.add_parser(name, help=help_text)
        sub.add_argument(
            "--cache-dir",
            default=argparse.SUPPRESS,
            help=Settings.model_fields["cache_dir"].description,
        )
    return parser


def _serve(settings: Settings) -> int:
    from server.engine.ray_cluster import wait_for_ray_nodes
    from server.engine.resolve import resolve
    from server.engine.vllm_engine import VllmEngine
    from server.traffic.runner import bind_listeners

    # A taken port, open access and a bad key file fail before minutes of model pulling
    # and loading.
    listeners = bind_listeners(settings.host, settings.port, _metrics_port(settings))
    keys = _api_keys(settings)
    engine_config = resolve(settings)
    if settings.ray_nodes is not None:
        wait_for_ray_nodes(settings.ray_nodes, settings.ray_join_timeout_seconds)
    logger.info(
        "serving %s (draft %s, method %s, speculation %s, K=%d)",
        engine_config.model,
        engine_config.draft_model,
        engine_config.speculative_method,
        engine_config.speculation_mode,
        engine_config.num_speculative_tokens,
    )
    return serve_engine(settings, VllmEngine(engine_config), keys, listeners)


def _metrics_port(settings: Settings) -> int | None:
    """The metrics port, or None where it is the API's own."""
    return None if settings.metrics_port == settings.port else settings.metrics_port


def _api_keys(settings: Settings) -> "ApiKeys | None":
    from server.traffic.api_keys import ApiKeys, load_key_ring

    if settings.open_access_refused:
        raise ConfigError(
            f"refusing to serve {settings.host} without --api-key-file: anyone who can reach "
            "it could use the API; give --api-key-file, listen on 127.0.0.1, or pass "
            "--allow-unauthenticated to serve it open"
        )
    if settings.api_key_file is None:
        logger.warning(
            "no --api-key-file: the API is open to anyone who can reach %s", settings.host
        )
        return None
    keys = ApiKeys(load_key_ring(settings.api_key_file), settings.api_key_file)
    logger.info("API keys loaded for %d tenants", len(keys.ring.tenants))
    return keys


def serve_engine(
    settings: Settings,
    engine: "Engine",
    keys: "ApiKeys | None",
    listeners: "list[socket.socket]",
) -> int:
    """Serve `engine` on `listeners` (`bind_listeners` for the settings' ports) the way
    `specserve serve` does (admission, lifecycle, drain, the settings' limits) until drained
    or the engine dies; return the exit status. The front-end benchmark
    (loadtest/frontend.py) serves an engine with no model through it."""
    from server.app import create_app
    from server.traffic.admission_queue import AdmissionController
    from server.traffic.lifecycle import Lifecycle
    from server.traffic.runner import run

    max_concurrent = settings.max_concurrent_requests or settings.max_num_seqs
    admission = AdmissionController(
        max_concurrent,
        settings.max_queued_requests,
        settings.queue_timeout_seconds,
        settings.max_queued_per_tenant,
        # Tenants under their share take up to the engine's worth more: it gives way.
        max_displacing=max_concurrent,
    )
    render_admission = AdmissionController(
        settings.max_concurrent_renders,
        settings.max_concurrent_renders,
        settings.queue_timeout_seconds,
    )
    lifecycle = Lifecycle()
    metrics_port = _metrics_port(settings)
    app = create_app(
        engine,
        baseline_tpot_seconds=settings.baseline_tpot_seconds,
        api_keys=keys,
        metrics_need_key=settings.metrics_need_key,
        public_docs=settings.public_docs,
        rate_limit_store=settings.rate_limit_store,
        rate_limit_on_store_failure=settings.rate_limit_on_store_failure,
        metrics_port=metrics_port,
        max_body_bytes=settings.max_body_bytes,
        max_concurrent_body_reads=settings.max_concurrent_body_reads,
        body_read_timeout_seconds=settings.body_read_timeout_seconds,
        admission=admission,
        render_admission=render_admission,
        request_timeout_seconds=settings.request_timeout_seconds,
        lifecycle=lifecycle,
        request_limits=settings.request_limits,
    )
    if metrics_port is not None:
        logger.info("metrics on http://%s:%d/metrics", settings.host, metrics_port)
    return run(
        app,
        listeners=listeners,
        lifecycle=lifecycle,
        admission=admission,
        drain_timeout_seconds=settings.drain_timeout_seconds,
        max_connections=settings.max_connections,
        keep_alive_timeout_seconds=settings.keep_alive_timeout_seconds,
        api_keys=keys,
    )


def _models(settings: Settings, command: str) -> None:
    from server.weights import embedded

    for model in embedded.EMBEDDED_PAIR:
        if command == "pull":
            from server.engine.resolve import prepare_draft, prepare_target

            folder = embedded.pull(settings.cache_dir, model)
            # What serving needs made once: the int8 copies asked for, the draft head's ranking.
            if model is embedded.DRAFT:
                prepare_draft(settings, str(folder))
            else:
                prepare_target(settings, str(folder))
        else:
            state = "cached" if embedded.is_pulled(settings.cache_dir, model) else "not pulled"
            print(f"{model.name}\t{state}\t{embedded.model_dir(settings.cache_dir, model)}")


def main(argv: list[str] | None = None) -> int:
    configure_root_logging("text")  # until the settings say which format
    args = vars(_parser().parse_args(argv))
    command = args.pop("command")
    models_command = args.pop("models_command", None)
    try:
        settings = Settings(**args)
        configure_logging(settings.log_format)
        if command == "serve":
            if settings.log_format == "json":
                route_output_as_json()
            return _serve(settings)
        else:
            _models(settings, models_command)
    except ValidationError as exc:
        for error in exc.errors():
            where = ".".join(str(part) for part in error["loc"])
            message = error["msg"].removeprefix("Value error, ")
            print(
                f"specserve: invalid setting{' ' + where if where else ''}: {message}",
                file=sys.stderr,
            )
        return 2
    except ConfigError as exc:
        print(f"specserve: {exc}", file=sys.stderr)
        return 2
    except ModelPullError as exc:
        print(f"specserve: {exc}", file=sys.stderr)
        return 1
    return 0
