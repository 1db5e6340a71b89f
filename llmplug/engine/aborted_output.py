"""The final output of a request that ended early: aborted by its caller, or lost with its data-parallel replica."""

from __future__ import annotations

from llmplug.core.outputs import CompletionOutput, RequestOutput
from llmplug.core.params import RequestOutputKind, SamplingParams

__all__ = ["aborted_output"]


def aborted_output(request_id: str, last: RequestOutput | None, params: SamplingParams,
                   error: str | None = None) -> RequestOutput:
    """Unfinished completions end with finish_reason "abort" (and `error`, when a failure ended them); a
    cumulative request keeps the text and tokens of its `last` output, a delta one adds nothing."""
    cumulative = params.output_kind != RequestOutputKind.DELTA
    previous = {c.index: c for c in last.outputs} if last is not None else {}
    outputs = []
    for index in range(params.n):
        before = previous.get(index)
        if before is not None and before.finish_reason is not None:
            continue
        text = before.text if (cumulative and before is not None) else ""
        token_ids = list(before.token_ids) if (cumulative and before is not None) else []
        outputs.append(CompletionOutput(index=index, text=text, token_ids=token_ids, finish_reason="abort",
                                        error=error))
    return RequestOutput(
        request_id=request_id,
        prompt=last.prompt if last is not None else None,
        prompt_token_ids=last.prompt_token_ids if last is not None else [],
        outputs=outputs,
        finished=True,
        metrics=last.metrics if last is not None else None,
    )
