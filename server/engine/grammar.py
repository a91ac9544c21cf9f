"""The bound on the grammar a request's JSON schema compiles to (API process).

vLLM's guidance backend turns the schema into an llguidance grammar in the API process (its
request checks, twice: `VllmEngine.validate` and again as the request is added) and then
compiles it in the EngineCore, on a thread pool of (cores + 1) // 2 workers, while the
request waits to be scheduled. Both build under llguidance's default limits, which a 3.5 KB
schema (anyOf inside allOf) fits while its compile takes seconds. `check` builds the same
grammar first, under `max_symbols`, in the thread that prepares the request: a schema whose
grammar is larger is a 400 naming the setting, and every later build of one that passes is
of a grammar within it. (What arrays add beyond llguidance's count of symbols is the request
limit --max-json-schema-items, checked before this.)
"""

import llguidance

from server.engine.contract import JsonFormat
from server.errors import InvalidRequestError

# Compact JSON: free whitespace between tokens would let a small model pad forever. The
# engine's setting (vllm_engine.py), and so the grammar checked here is the one it compiles.
COMPACT_JSON = True
# How llguidance says a grammar is over `max_grammar_size` (tests pin it to the installed one).
TOO_BIG = "grammar size (number of symbols) too big"


def check(json_format: JsonFormat, max_symbols: int) -> None:
    """Refuse a JSON schema whose grammar is over `max_symbols`, or that llguidance cannot
    build at all: a 400 whose param is the request field it came from."""
    if json_format.schema is None:
        return  # any JSON object: a grammar of a few symbols
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json_format.schema, defaults={"whitespace_flexible": not COMPACT_JSON}
    )
    limits = llguidance.LLParserLimits(max_grammar_size=max_symbols)
    error = _build_error(grammar, limits)
    if TOO_BIG in error:
        raise InvalidRequestError(
            f"the schema's grammar must have at most {max_symbols} symbols (--max-grammar-symbols)",
            param=json_format.param,
        )
    if error:
        raise InvalidRequestError(
            f"grammar error: {error.splitlines()[0]}", param=json_format.param
        )


def _build_error(grammar: str, limits: llguidance.LLParserLimits) -> str:
    """What llguidance says building the grammar under `limits` fails on ("" if nothing)."""
    try:
        return llguidance.LLMatcher.validate_grammar(grammar, None, limits=limits)
    except BaseException as exc:
        # Where the size limit trips inside some of its builders llguidance panics instead,
        # raising pyo3's PanicException, which is no Exception.
        if type(exc).__name__ != "PanicException":
            raise
        return str(exc)
