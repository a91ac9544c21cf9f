"""The package rules docs/development.md states, read from every import in server/ (function
level included): the arrows api -> serving -> engine -> autopilot point one way; vllm_plugins/
uses only autopilot/ and weights/ of the server's, and only engine/ imports it, naming only what
the adapter hands vLLM's processes or reads of them; vllm_plugins/ imports vLLM inside functions
only, but for autopilot_scheduler, which nothing imports; the leaf packages import nothing of
the server's, autopilot/ only the standard library; and only engine/ and vllm_plugins/ import
vLLM."""

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

SERVER = Path(__file__).resolve().parents[2] / "server"
LAYERS = ("api", "serving", "engine", "autopilot")  # each may use those after it
LEAVES = ("autopilot", "protocol", "weights", "metrics", "errors")  # none of the server's others
VLLM_USERS = ("engine", "vllm_plugins")
PLUGINS_USE = ("autopilot", "weights")  # all vllm_plugins/ may import of the server's
# All engine/ may import of vllm_plugins/: what the adapter hands vLLM's processes or reads.
ENGINE_USES = (
    "registry",
    "vllm_source",
    "patching",
    "autopilot_patch",
    "request_args",
    "cpu_flags",
    "cpu_memory",
)
# The one module of vllm_plugins/ that imports vLLM as it loads; vLLM loads it by name.
SCHEDULER = "server.vllm_plugins.autopilot_scheduler"


def _imports(nodes: Iterable[ast.AST]) -> set[str]:
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.count(".") < 2:
                # `from server import metrics`, `from server.vllm_plugins import registry`: what
                # is imported may be a module, which the rules name.
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
            else:
                names.add(node.module)
    return names


def _upward(package: str, target: str) -> bool:
    return package in LAYERS and target in LAYERS and LAYERS.index(target) < LAYERS.index(package)


def violations(root: Path) -> list[str]:
    """Every import under `root` (a server/ tree) that breaks a rule, as "file: import"."""
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).with_suffix("")
        package = relative.parts[0]
        tree = ast.parse(path.read_text())
        if package == "vllm_plugins" and ".".join(("server", *relative.parts)) != SCHEDULER:
            found += [
                f"{relative}: {name} (vllm_plugins/ imports vLLM inside functions only)"
                for name in sorted(_imports(tree.body))
                if name.partition(".")[0] == "vllm"
            ]
        for name in sorted(_imports(ast.walk(tree))):
            top, _, rest = name.partition(".")
            if top == "vllm" and package not in VLLM_USERS:
                found.append(f"{relative}: {name} (only engine/ and vllm_plugins/ import vLLM)")
            if top != "server":
                if package == "autopilot" and top not in sys.stdlib_module_names:
                    found.append(f"{relative}: {name} (autopilot/ is standard library only)")
                continue
            target, _, inside = rest.partition(".")
            if name.startswith(SCHEDULER):
                found.append(f"{relative}: {name} (vLLM loads it by name)")
            elif target == package:
                continue
            elif package in LEAVES:
                found.append(f"{relative}: {name} ({package} imports none of the server's)")
            elif package == "vllm_plugins" and target not in PLUGINS_USE:
                found.append(f"{relative}: {name} (vllm_plugins/ uses only autopilot/, weights/)")
            elif _upward(package, target):
                found.append(f"{relative}: {name} (against the arrows)")
            elif target == "vllm_plugins" and package != "engine":
                found.append(f"{relative}: {name} (only engine/ imports vllm_plugins/)")
            elif target == "vllm_plugins" and inside.split(".")[0] not in ENGINE_USES:
                found.append(f"{relative}: {name} (engine/ may not name it)")
    return found


def test_the_servers_imports_keep_the_rules() -> None:
    assert violations(SERVER) == []


def test_an_import_against_the_rules_is_found(tmp_path: Path) -> None:
    sources = {
        "engine/adapter.py": (
            "from server.serving import common\nimport vllm\n"
            "from server.vllm_plugins import draft_sync, registry\n"
            "from server.vllm_plugins.request_args import TENANT_ARG\n"
        ),
        "autopilot/policy.py": "import numpy\nfrom server import metrics\n",
        "serving/chat.py": "def f():\n    from vllm import SamplingParams\n",
        "serving/common.py": "from server.vllm_plugins import request_args\n",
        "api/chat.py": "from server.serving import chat\nfrom server.engine import contract\n",
        "vllm_plugins/glue.py": (
            "import vllm\nfrom server import metrics\nfrom server.engine.hardware import x\n"
            "from server.autopilot.reports import DraftReport\n"
            "from server.weights import draft_vocab\nfrom server.vllm_plugins import patching\n"
            "def f():\n    from vllm import SamplingParams\n"
        ),
        "vllm_plugins/autopilot_scheduler.py": "from vllm.v1.core.sched import scheduler\n",
        "vllm_plugins/registry.py": "from server.vllm_plugins import autopilot_scheduler\n",
    }
    for name, text in sources.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert violations(tmp_path) == [
        "autopilot/policy: numpy (autopilot/ is standard library only)",
        "autopilot/policy: server.metrics (autopilot imports none of the server's)",
        "engine/adapter: server.serving.common (against the arrows)",
        "engine/adapter: server.vllm_plugins.draft_sync (engine/ may not name it)",
        "serving/chat: vllm.SamplingParams (only engine/ and vllm_plugins/ import vLLM)",
        "serving/common: server.vllm_plugins.request_args (only engine/ imports vllm_plugins/)",
        "vllm_plugins/glue: vllm (vllm_plugins/ imports vLLM inside functions only)",
        "vllm_plugins/glue: server.engine.hardware (vllm_plugins/ uses only autopilot/, weights/)",
        "vllm_plugins/glue: server.metrics (vllm_plugins/ uses only autopilot/, weights/)",
        "vllm_plugins/registry: server.vllm_plugins.autopilot_scheduler (vLLM loads it by name)",
    ]
