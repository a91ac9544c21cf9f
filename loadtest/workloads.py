"""Bundled workloads and the user's own prompts (JSONL).

Each bundled workload has a character that decides how much speculation can
help: code completion, fill in the middle and structured output repeat what
the prompt already holds (drafts are accepted often), code edits mostly repeat
the prompt's code (lookups propose it for free), prose is open-ended
(accepted rarely). `structured` asks for JSON under `response_format` (a JSON
schema or JSON mode), `fim` sends code with a hole (`suffix`), so both run
through the grammar and fill-in-the-middle paths. `multi-turn` (each turn
sent with the turns before it) and `shared-system-prompt` (an agent's long
system prompt and tools before short tasks) share prompt prefixes between
requests: what the server's prefix cache reuses. `agent` (loadtest/agent_tasks.py)
is a coding agent's tool calls, each turn sent with the conversation before it:
its replies repeat the file a tool read, the file it wrote before and the command
it ran, what lookups in the prompt and in the tenant's replies propose. loadtest
sends one API key per server, so all of a run's requests are one tenant's.

JSONL: one object per line, either {"prompt": "..."} for /v1/completions or
{"messages": [...]} for /v1/chat/completions, optionally "max_tokens", "id",
"suffix" (with "prompt") and "response_format".
"""

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from loadtest.agent_tasks import TASKS, Task


@dataclass(frozen=True)
class WorkItem:
    id: str
    endpoint: Literal["completions", "chat"]
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content)
    # Chat messages as OpenAI's objects, where (role, content) cannot say them: assistant
    # tool calls and the tool results that answer them. Instead of `messages`.
    conversation: tuple[dict[str, Any], ...] | None = None
    tools: tuple[dict[str, Any], ...] | None = None  # chat only: OpenAI function tools
    max_tokens: int | None = None
    suffix: str | None = None  # completions only: fill in the middle
    response_format: dict[str, Any] | None = None
    # Items of one session (an agent's conversation, turn by turn) are sent in their order,
    # one after the other: each turn's prompt extends the one before, as an agent sends them.
    session: str | None = None

    def payload(
        self, model: str, max_tokens: int, temperature: float, stream: bool
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": self.max_tokens or max_tokens,
            "temperature": temperature,
        }
        if self.endpoint == "completions":
            body["prompt"] = self.prompt
            if self.suffix is not None:
                body["suffix"] = self.suffix
        elif self.conversation is not None:
            body["messages"] = list(self.conversation)
        else:
            body["messages"] = [{"role": r, "content": c} for r, c in self.messages or ()]
        if self.tools is not None:
            body["tools"] = list(self.tools)
        if self.response_format is not None:
            body["response_format"] = self.response_format
        if stream:
            body["stream"] = True
            # The usage chunk carries the exact output token count (and specserve's
            # per-request speculation summary).
            body["stream_options"] = {"include_usage": True}
        return body

    @property
    def path(self) -> str:
        return "/v1/completions" if self.endpoint == "completions" else "/v1/chat/completions"


def _chat(name: str, prompts: list[str]) -> list[WorkItem]:
    return [WorkItem(f"{name}-{i}", "chat", messages=(("user", p),)) for i, p in enumerate(prompts)]


CODE_COMPLETION = [
    WorkItem(f"code-completion-{i}", "completions", prompt=p)
    for i, p in enumerate(
        [
            'def parse_csv(path: str) -> list[dict[str, str]]:\n    """Read a CSV file with '
            'a header row into a list of dicts."""\n',
            "class LRUCache:\n    def __init__(self, capacity: int) -> None:\n"
            "        self.capacity = capacity\n",
            'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n',
            "import json\n\n\ndef load_config(path):\n    with open(path) as f:\n",
            "function debounce(fn, ms) {\n  let timer;\n  return function (...args) {\n",
            'def is_palindrome(s: str) -> bool:\n    """True if s reads the same both ways, '
            'ignoring case and non-letters."""\n',
            "SELECT customers.name, COUNT(orders.id) AS order_count\nFROM customers\n",
            "def binary_search(items: list[int], target: int) -> int:\n    low, high = 0, "
            "len(items) - 1\n",
        ]
    )
]

CODING_CHAT = _chat(
    "coding-chat",
    [
        "Write a Python function that reverses the words in a sentence, with type hints.",
        "Explain the difference between a list and a tuple in Python, with a short example.",
        "Write a Python class for a stack with push, pop and peek methods.",
        "How do I read a JSON file in Python and print one of its keys? Show code.",
        "Write a Python function that checks whether a number is prime.",
        "Write a bash one-liner that counts the lines of every .py file in a folder.",
        "Write a Python function that merges two sorted lists into one sorted list.",
        "Show how to use a Python dataclass for a 2D point with a distance method.",
    ],
)

_EDITED_CODE = [
    "def average(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total / len(values)\n\n\ndef median(values):\n    ordered = sorted(values)\n"
    "    middle = len(ordered) // 2\n    if len(ordered) % 2:\n        return ordered[middle]\n"
    "    return (ordered[middle - 1] + ordered[middle]) / 2\n",
    "class Account:\n    def __init__(self, owner, balance=0):\n        self.owner = owner\n"
    "        self.balance = balance\n\n    def deposit(self, amount):\n"
    "        self.balance += amount\n        return self.balance\n\n"
    "    def withdraw(self, amount):\n        if amount > self.balance:\n"
    '            raise ValueError("insufficient funds")\n        self.balance -= amount\n'
    "        return self.balance\n",
    "import json\n\n\ndef load_users(path):\n    with open(path) as f:\n"
    '        data = json.load(f)\n    users = []\n    for item in data["users"]:\n'
    '        if item.get("active"):\n            users.append(item["name"])\n    return users\n',
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n"
    '        word = word.lower().strip(".,!?")\n        if word in counts:\n'
    "            counts[word] += 1\n        else:\n            counts[word] = 1\n"
    "    return counts\n",
]

# Edits of code the prompt holds: the reply repeats most of it (what prompt lookups propose).
CODE_EDIT = _chat(
    "code-edit",
    [
        f"{task}\n\n```python\n{code}```"
        for code in _EDITED_CODE
        for task in (
            "Add type hints to this code. Reply with the whole updated code only.",
            "Rename every variable to a more descriptive name in this code. Reply with the "
            "whole updated code only.",
        )
    ],
)

# An agent's conversations: each item is one turn, sent with every earlier turn of its
# conversation (scripted assistant replies), so later turns share their prefix with earlier ones.
_TURNS = (
    "Here is some code of mine:\n\n```python\n{code}```\n\nExplain briefly what it does.",
    "Add type hints to it. Reply with the whole updated code only.",
    "Now add a one-line docstring to each function. Reply with the code only.",
    "Write a pytest unit test for it.",
)
_REPLIES = (
    "It defines small helpers that walk over their input once and return the result; the "
    "names say what each one computes.",
    "```python\n{code}```",
    "```python\n{code}```",
)


def _conversation(name: str, code: str) -> list[WorkItem]:
    items = []
    history: list[tuple[str, str]] = []
    for turn, (question, reply) in enumerate(zip(_TURNS, (*_REPLIES, ""), strict=True)):
        history.append(("user", question.format(code=code)))
        items.append(WorkItem(f"{name}-turn{turn + 1}", "chat", messages=tuple(history)))
        history.append(("assistant", reply.format(code=code)))
    return items


MULTI_TURN = [
    item for i, code in enumerate(_EDITED_CODE) for item in _conversation(f"multi-turn-{i}", code)
]

_AGENT_TOOLS = [
    {
        "name": name,
        "description": description,
        "parameters": {
            "type": "object",
            "properties": {p: {"type": "string", "description": d} for p, d in parameters},
            "required": [p for p, _ in parameters],
        },
    }
    for name, description, parameters in [
        ("read_file", "Read a file of the repository.", [("path", "Path from the root.")]),
        (
            "write_file",
            "Replace a file's content; create it if missing.",
            [("path", "Path from the root."), ("content", "The whole new content.")],
        ),
        (
            "search_code",
            "Find lines matching a regular expression in the repository.",
            [("pattern", "A Python regular expression."), ("glob", "Files to search.")],
        ),
        ("run_tests", "Run the test suite or part of it.", [("selector", "A pytest node id.")]),
        ("run_shell", "Run a shell command in the sandbox.", [("command", "The command.")]),
        ("list_dir", "List a folder of the repository.", [("path", "Path from the root.")]),
        (
            "open_issue",
            "Open an issue in the tracker.",
            [("title", "One line."), ("body", "Markdown.")],
        ),
        ("git_diff", "Show the working tree's changes.", [("path", "Limit to this path.")]),
    ]
]
_AGENT_RULES = (
    "You are a coding agent working in a Python repository on behalf of its maintainers. "
    "Follow these rules in every reply.\n"
    + "\n".join(
        f"{number}. {rule}"
        for number, rule in enumerate(
            [
                "Read the files you change before you change them, and keep their style.",
                "Make the smallest change that solves the task; do not reformat unrelated code.",
                "Run the tests that cover your change, and say which ones you ran.",
                "Never commit secrets, credentials or personal data, and never print them.",
                "Prefer the standard library; add a dependency only when the task needs one.",
                "Explain what you did in at most five sentences, then show the diff.",
                "When a command fails, read its output before you try anything else.",
                "Ask one clear question when the task is ambiguous instead of guessing.",
                "Write type hints and a docstring for every public function you add.",
                "Keep functions short; name them for what they return or do.",
            ],
            start=1,
        )
    )
)
_AGENT_SYSTEM_PROMPT = (
    _AGENT_RULES
    + "\n\nYou can call these tools; answer with one JSON call per line when you use them:\n"
    + json.dumps(_AGENT_TOOLS, indent=1)
)

# An agent's long system prompt with its tools before each short task: every request shares
# that prefix with every other.
SHARED_SYSTEM_PROMPT = [
    WorkItem(
        f"shared-system-prompt-{i}",
        "chat",
        messages=(("system", _AGENT_SYSTEM_PROMPT), ("user", task)),
    )
    for i, task in enumerate(
        [
            "The function median in stats.py crashes on an empty list. Fix it.",
            "Add a --verbose flag to the command line in cli.py.",
            "Find every place that opens a file without a with statement.",
            "Rename the class Account to BankAccount everywhere.",
            "Write a test for load_users in users.py.",
            "Why does test_deposit fail? Look at the code and explain.",
            "List the modules that import json and say what each uses it for.",
            "Make count_words ignore words shorter than three letters.",
        ]
    )
]


def _agent_conversation(task: Task) -> list[WorkItem]:
    """One item per turn: the task, then each tool call and its result in turn (read the file,
    write the first attempt, run the tests, write the fix, run them again)."""
    first, fixed = task.attempts()
    steps = [
        ("read_file", {"path": task.path}, task.source),
        ("write_file", {"path": task.path, "content": first}, _wrote(task.path, first)),
        ("run_tests", {"selector": task.tests}, task.failure),
        ("write_file", {"path": task.path, "content": fixed}, _wrote(task.path, fixed)),
        ("run_tests", {"selector": task.tests}, task.passed),
    ]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": _AGENT_RULES},
        {"role": "user", "content": task.request},
    ]
    for step, (name, arguments, output) in enumerate(steps, start=1):
        call_id = f"call_{task.name}_{step}"
        call = {"name": name, "arguments": json.dumps(arguments)}
        messages += [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": call_id, "type": "function", "function": call}],
            },
            {"role": "tool", "tool_call_id": call_id, "content": output},
        ]
    return [
        WorkItem(
            f"agent-{task.name}-turn{turn}",
            "chat",
            conversation=tuple(messages[: 2 * turn]),
            tools=_AGENT_FUNCTION_TOOLS,
            session=f"agent-{task.name}",
        )
        for turn in range(1, len(steps) + 2)
    ]


def _wrote(path: str, content: str) -> str:
    return f"Wrote {len(content.encode())} bytes to {path}."


_AGENT_FUNCTION_TOOLS = tuple({"type": "function", "function": tool} for tool in _AGENT_TOOLS)
# A coding agent's conversations, each turn with the conversation before it: later replies
# repeat the file the agent read, the file it wrote and the command it ran.
AGENT = [item for task in TASKS for item in _agent_conversation(task)]

PROSE = _chat(
    "prose",
    [
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Describe a busy market in a mountain town at dawn.",
        "Write a letter from a retired sailor to his granddaughter.",
        "Tell a fable about a fox and a heron who share a river.",
        "Write the opening paragraph of a mystery novel set on a night train.",
        "Describe the first day of spring from the point of view of an old oak tree.",
        "Write a short speech a teacher gives on the last day of school.",
        "Write a travel diary entry about getting lost in a city you have never visited.",
    ],
)

_ROWS = "\n".join(
    f"{i},{name},{city},{age}"
    for i, (name, city, age) in enumerate(
        [
            ("Alice", "Paris", 34),
            ("Bob", "Berlin", 28),
            ("Carla", "Madrid", 41),
            ("Dmitri", "Riga", 37),
            ("Emma", "Oslo", 25),
            ("Farid", "Cairo", 52),
        ],
        start=1,
    )
)

_CSV = f"id,name,city,age\n{_ROWS}"


def _schema(name: str, properties: dict[str, Any]) -> dict[str, Any]:
    """response_format for a JSON object with these properties, all required."""
    schema = {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


_PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "city": {"type": "string"},
        "age": {"type": "integer"},
    },
    "required": ["id", "name", "city", "age"],
    "additionalProperties": False,
}
_JSON_MODE = {"type": "json_object"}

STRUCTURED = [
    WorkItem(f"structured-{i}", "chat", messages=(("user", prompt),), response_format=format_)
    for i, (prompt, format_) in enumerate(
        [
            (
                f"Convert this CSV to JSON, one object per row under people:\n{_CSV}",
                _schema("people", {"people": {"type": "array", "items": _PERSON}}),
            ),
            (f"Give this CSV as a JSON object mapping each name to its city:\n{_CSV}", _JSON_MODE),
            (
                "List the numbers from 1 to 20 with their squares as JSON.",
                _schema(
                    "squares",
                    {
                        "squares": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {
                                    "n": {"type": "integer"},
                                    "square": {"type": "integer"},
                                },
                                "required": ["n", "square"],
                                "additionalProperties": False,
                            },
                        }
                    },
                ),
            ),
            (
                f"Which person in this CSV is the oldest? Answer as JSON.\n{_CSV}",
                _schema("oldest", _PERSON["properties"]),
            ),
            (
                "Give a JSON object mapping each month name to its number of days (non-leap year).",
                _JSON_MODE,
            ),
            (
                f"Group the people of this CSV by decade of age, as JSON:\n{_CSV}",
                _schema(
                    "decades",
                    {
                        "groups": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {
                                    "decade": {"type": "integer"},
                                    "names": {"type": "array", "items": {"type": "string"}},
                                },
                                "required": ["decade", "names"],
                                "additionalProperties": False,
                            },
                        }
                    },
                ),
            ),
        ]
    )
]

FIM = [
    WorkItem(f"fim-{i}", "completions", prompt=prefix, suffix=suffix)
    for i, (prefix, suffix) in enumerate(
        [
            (
                'def parse_csv(path: str) -> list[dict[str, str]]:\n    """Read a CSV file with '
                'a header row into a list of dicts."""\n',
                '\n\n\nrows = parse_csv("people.csv")\nprint(rows[0]["name"])\n',
            ),
            (
                "class Stack:\n    def __init__(self) -> None:\n"
                "        self.items: list[int] = []\n\n    def push(self, item: int) -> None:\n",
                "\n    def pop(self) -> int:\n        return self.items.pop()\n",
            ),
            (
                'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n',
                "\n\n\nassert fibonacci(10) == 55\n",
            ),
            (
                "import json\n\n\ndef load_config(path):\n",
                '\n    return config\n\n\nconfig = load_config("settings.json")\n',
            ),
            (
                "function debounce(fn, ms) {\n  let timer;\n",
                '\n}\n\nconst save = debounce(() => console.log("saved"), 300);\n',
            ),
            (
                "def binary_search(items: list[int], target: int) -> int:\n    low, high = 0, "
                "len(items) - 1\n",
                "\n    return -1\n\n\nassert binary_search([1, 3, 5, 7], 5) == 2\n",
            ),
        ]
    )
]

BUNDLED: dict[str, list[WorkItem]] = {
    "agent": AGENT,
    "code-completion": CODE_COMPLETION,
    "code-edit": CODE_EDIT,
    "coding-chat": CODING_CHAT,
    "fim": FIM,
    "multi-turn": MULTI_TURN,
    "prose": PROSE,
    "shared-system-prompt": SHARED_SYSTEM_PROMPT,
    "structured": STRUCTURED,
}


def load(name_or_path: str) -> list[WorkItem]:
    """A bundled workload by name, or the user's JSONL file."""
    if name_or_path in BUNDLED:
        return BUNDLED[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"workload {name_or_path!r}: not one of {sorted(BUNDLED)} and not a file")
    return load_jsonl(path)


def load_jsonl(path: Path) -> list[WorkItem]:
    items = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc})") from exc
        if not isinstance(data, dict) or ("prompt" in data) == ("messages" in data):
            raise ValueError(f"{where}: need an object with exactly one of prompt, messages")
        max_tokens = data.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"{where}: max_tokens must be a positive integer")
        item_id = str(data.get("id", f"{path.stem}-{number}"))
        response_format = data.get("response_format")
        if response_format is not None and not isinstance(response_format, dict):
            raise ValueError(f"{where}: response_format must be an object")
        suffix = data.get("suffix")
        if suffix is not None and ("prompt" not in data or not isinstance(suffix, str)):
            raise ValueError(f"{where}: suffix must be a string, next to a prompt")
        if "prompt" in data:
            if not isinstance(data["prompt"], str):
                raise ValueError(f"{where}: prompt must be a string")
            items.append(
                WorkItem(
                    item_id,
                    "completions",
                    prompt=data["prompt"],
                    max_tokens=max_tokens,
                    suffix=suffix,
                    response_format=response_format,
                )
            )
            continue
        messages = data["messages"]
        if not isinstance(messages, list) or not all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise ValueError(f"{where}: messages must be a list of {{role, content}} strings")
        items.append(
            WorkItem(
                item_id,
                "chat",
                messages=tuple((m["role"], m["content"]) for m in messages),
                max_tokens=max_tokens,
                response_format=response_format,
            )
        )
    if not items:
        raise ValueError(f"{path}: no prompts")
    return items


def sequence(items: list[WorkItem], seed: int) -> "RequestSequence":
    return RequestSequence(items, seed)


class RequestSequence:
    """The endless, seeded order in which items are sent: a fresh shuffle of
    all items per pass, so every item is used equally and runs repeat exactly.
    A session's items move as one, in their order (WorkItem.session)."""

    def __init__(self, items: list[WorkItem], seed: int) -> None:
        sessions: dict[str, list[WorkItem]] = {}
        for item in items:
            sessions.setdefault(item.session or item.id, []).append(item)
        self._sessions = list(sessions.values())
        self._rng = random.Random(seed)
        self._order: list[WorkItem] = []

    def take(self, count: int) -> list[WorkItem]:
        while len(self._order) < count:
            batch = list(self._sessions)
            self._rng.shuffle(batch)
            self._order.extend(item for session in batch for item in session)
        taken, self._order = self._order[:count], self._order[count:]
        return taken
