"""Running schemathesis' checks against the server, in process or over HTTP, and the one refusal JSON Schema cannot
describe: a prompt that, with the token budget asked for, does not fit the context (a 400 context_length_exceeded
for a schema-valid body). Such a refusal is accepted only where the tokens, counted here independently of the
server, really overflow; any other failure of any check counts."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from adaflash.models.targets.text_codec import TextCodec
from adaflash.server.protocol import ChatCompletionRequest, CompletionRequest

CONTEXT = re.compile(r"maximum context length is (\d+) tokens")


def overflows_context(path: str, body, codec: TextCodec, context: int) -> bool:
    """Whether the request at `path` asks for more tokens than `context` holds: its prompt (tokenized here, as the
    server's TextCodec does) plus the largest token bound it gives (each must fit, as the schema states)."""
    if path.endswith("/chat/completions"):
        request = ChatCompletionRequest.model_validate(body)
        prompt = codec.encode(messages=[m.for_template() for m in request.messages])
    else:
        request = CompletionRequest.model_validate(body)
        prompt = codec.encode(prompt=request.prompt)
    asked = max(request.token_limits().values(), default=1)
    return len(prompt) + asked > context


def is_context_refusal(check: str, status: int, payload) -> bool:
    return (check == "positive_data_acceptance" and status == 400 and isinstance(payload, dict)
            and (payload.get("error") or {}).get("code") == "context_length_exceeded")


@dataclass
class Outcome:
    failures: list[tuple] = field(default_factory=list)  # (phase, operation, check, title, body, status, response)
    context_refusals: int = 0  # schema-valid bodies refused for the context, each verified to overflow it
    statuses: dict[tuple[str, int], int] = field(default_factory=dict)  # (operation, status) -> responses
    media_types: set[tuple[str, str]] = field(default_factory=set)  # (operation, media type) answered with 200
    errors: list[str] = field(default_factory=list)  # schemathesis' own errors (a schema it cannot read, ...)


def run_in_process(app, config: dict, codec: TextCodec, context: int) -> Outcome:
    """Every phase and check of `schemathesis run` against the ASGI `app` (config: schemathesis.toml's keys)."""
    import schemathesis
    from schemathesis.config import SchemathesisConfig
    from schemathesis.engine import events, from_schema

    schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=SchemathesisConfig.from_dict(config))
    outcome = Outcome()
    for event in from_schema(schema).execute():
        if isinstance(event, (events.NonFatalError, events.FatalError)):
            outcome.errors.append(str(getattr(event, "info", event)))
        if not isinstance(event, events.ScenarioFinished):
            continue
        recorder = event.recorder
        for interaction in recorder.interactions.values():
            if interaction.response is not None:
                key = (event.label or "", interaction.response.status_code)
                outcome.statuses[key] = outcome.statuses.get(key, 0) + 1
                media = interaction.response.headers.get("content-type", [""])[0].split(";")[0]
                if interaction.response.status_code == 200:
                    outcome.media_types.add((event.label or "", media))
        for case_id, checks in recorder.checks.items():
            for check in checks:
                if check.status.name != "FAILURE":
                    continue
                case = recorder.cases[case_id].value
                response = recorder.interactions[case_id].response if case_id in recorder.interactions else None
                status = response.status_code if response is not None else None
                payload = _json(response)
                if is_context_refusal(check.name, status, payload) and overflows_context(case.path, case.body, codec,
                                                                                         context):
                    outcome.context_refusals += 1
                    continue
                title = check.failure_info.failure.title if check.failure_info else ""
                outcome.failures.append((event.phase.name, event.label, check.name, title, case.body, status,
                                         payload))
    return outcome


def _json(response):
    if response is None:
        return None
    try:
        import json

        return json.loads(response.content)
    except ValueError:
        return None
