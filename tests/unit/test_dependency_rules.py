"""The package rules docs/development.md states, read from every import in server/ (function
level included): the arrows api -> serving -> engine -> autopilot point one way, the leaf
packages import nothing of the server's, autopilot/ only the standard library, and only
engine/ and vllm_plugins/ import vLLM."""

import ast
import sys
from pathlib import Path

SERVER = Path(__file__).resolve().parents[2] / "server"
LAYERS = ("api", "serving", "engine", "autopilot")  # each may use those after it
LEAVES = ("autopilot", "protocol", "weights", "metrics", "errors")  # none of the server's others


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "server":
                names.update(f"server.{alias.name}" for alias in node.names)
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
        for name in sorted(_imports(path)):
            top, _, rest = name.partition(".")
            if top == "vllm" and package not in ("engine", "vllm_plugins"):
                found.append(f"{relative}: {name} (only engine/ and vllm_plugins/ import vLLM)")
            if top != "server":
                if package == "autopilot" and top not in sys.stdlib_module_names:
                    found.append(f"{relative}: {name} (autopilot/ is standard library only)")
                continue
            target = rest.split(".")[0]
            if target == package:
                continue
            if package in LEAVES:
                found.append(f"{relative}: {name} ({package} imports none of the server's)")
            elif _upward(package, target):
                found.append(f"{relative}: {name} (against the arrows)")
    return found


def test_the_servers_imports_keep_the_rules() -> None:
    assert violations(SERVER) == []


def test_an_import_against_the_rules_is_found(tmp_path: Path) -> None:
    sources = {
        "engine/adapter.py": "from server.serving import common\nimport vllm\n",
        "autopilot/policy.py": "import numpy\nfrom server import metrics\n",
        "serving/chat.py": "def f():\n    from vllm import SamplingParams\n",
        "api/chat.py": "from server.serving import chat\nfrom server.engine import contract\n",
    }
    for name, text in sources.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert violations(tmp_path) == [
        "autopilot/policy: numpy (autopilot/ is standard library only)",
        "autopilot/policy: server.metrics (autopilot imports none of the server's)",
        "engine/adapter: server.serving (against the arrows)",
        "serving/chat: vllm (only engine/ and vllm_plugins/ import vLLM)",
    ]
