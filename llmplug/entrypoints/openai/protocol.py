"""Request and response bodies of the OpenAI API (chat, completions, responses, models), as pydantic models.

Field names, defaults and bounds follow OpenAI's schema; the extra sampling fields vLLM accepts (top_k,
min_p, repetition_penalty, ignore_eos, min_tokens, stop_token_ids, structured_outputs, ...) are accepted
too. Unknown fields are kept (`extra="allow"`) and ignored, as vLLM does, so clients sending newer fields
keep working; `ignored_fields` names them, for the log.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

# --- bounds -------------------------------------------------------------------------------------
# The schema at GET /openapi.json states what the server accepts, so clients (and the fuzz tests) see
# the real contract: every number fits the engine's integer types, every list and string is finite.
# Checks that depend on the model (vocabulary, context length) are the engine's, with 400s naming them.

MAX_COUNT = 2**31 - 1  # token counts and token ids
# token ids: 32-bit here; the engine checks them against the vocabulary, with a 400 naming the field
TokenId = Annotated[int, Field(ge=-MAX_COUNT - 1, le=MAX_COUNT)]
Count = Annotated[int, Field(ge=1, le=MAX_COUNT)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
Name = Annotated[str, Field(max_length=256)]
# finite, and looser than the engine's own configurable limits (decoding.max_stop_strings, ...), which decide
StopString = Annotated[str, Field(max_length=4096)]
Stop = StopString | Annotated[list[StopString], Field(max_length=1024)]
Priority = Annotated[int, Field(ge=-MAX_COUNT - 1, le=MAX_COUNT)]  # 32-bit, as vLLM's clients send it
LogitBias = Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]], Field(max_length=1024)]

# --- common -------------------------------------------------------------------------------------


class OpenAIModel(BaseModel):
    """Base of every body: unknown request fields are accepted and ignored."""

    model_config = ConfigDict(extra="allow")


def ignored_fields(body: BaseModel, where: str = "") -> list[str]:
    """The paths of the fields in `body` (and the bodies inside it) that no model declares."""
    found = [f"{where}{name}" for name in body.model_extra or {}]
    for name in type(body).model_fields:
        value = getattr(body, name)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, BaseModel):
                index = f"[{i}]" if isinstance(value, list) else ""
                found += ignored_fields(item, f"{where}{name}{index}.")
    return found


class StreamOptions(OpenAIModel):
    """`stream_options`: a last chunk with the token usage, and (vLLM) usage in every chunk."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIModel):
    """Token counts of a request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class JsonSchemaFormat(OpenAIModel):
    """`response_format.json_schema`: the schema the answer must follow."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # `schema` would shadow a BaseModel method
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """`response_format`: plain text, any JSON object, or JSON following `json_schema`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(OpenAIModel):
    """vLLM's `structured_outputs`: one constraint on the answer (the newer name of the `guided_*` fields)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    json_: str | dict[str, Any] | None = Field(None, alias="json")  # `json` would shadow a BaseModel method
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool | None = None  # True: compact JSON (no whitespace between tokens)


class SamplingRequest(OpenAIModel):
    """The sampling fields chat and completions requests share (OpenAI's and vLLM's extras)."""

    model: Name | None = None
    n: int = Field(1, ge=1, le=MAX_COUNT)  # the engine's decoding.max_n bounds it
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: LogitBias | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Name | None = None
    # vLLM's extra sampling fields
    top_k: int | None = Field(None, ge=-1, le=MAX_COUNT)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=MAX_COUNT)
    stop_token_ids: Annotated[list[TokenId], Field(max_length=1024)] | None = None
    bad_words: Annotated[list[StopString], Field(max_length=1024)] | None = None
    allowed_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    # vLLM's beam search: `n` beams, ranked by cum_logprob / num_tokens ** length_penalty
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, ge=-100.0, le=100.0)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # vLLM's: the top-k logprobs of each prompt token (the engine's decoding.max_logprobs bounds it)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_COUNT)
    # vLLM's scheduling priority: lower values are served first; only with scheduler.policy "priority"
    priority: Priority = 0
    # structured output: OpenAI's response_format (also accepted on completions, as vLLM does) or vLLM's extras
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1, max_length=1024)] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: Name | None = None
    structured_outputs: StructuredOutputs | None = None


# --- /v1/chat/completions -----------------------------------------------------------------------


class ImageURL(OpenAIModel):
    """`image_url` of an image part: a data:image/...;base64 URL, or a file:// or http(s) URL the server allows."""

    url: str | None = None  # required: a part without it is a 400 naming it (after the model check)
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor decides the resolution


class InputAudio(OpenAIModel):
    """`input_audio` of an audio part (OpenAI's): the base64 text of an encoded clip and its format."""

    data: str | None = None  # required: a part without it is a 400 naming it (after the model check)
    format: str | None = None  # "wav", "mp3", ...: accepted; the decoder reads the format from the data


class AudioURL(OpenAIModel):
    """`audio_url` of an audio part (vLLM's): a data:audio/...;base64 URL, or a file:// or http(s) URL the server
    allows."""

    url: str | None = None


class ContentPart(OpenAIModel):
    """One part of a message's content: `{"type": "text", "text": ...}`, `{"type": "image_url", "image_url":
    {"url": ...}}` (for a model that takes images), `{"type": "input_audio", "input_audio": {"data": ..., "format":
    ...}}` or `{"type": "audio_url", "audio_url": {"url": ...}}` (for a model that takes audio)."""

    type: str
    text: str | None = None
    image_url: ImageURL | None = None
    input_audio: InputAudio | None = None
    audio_url: AudioURL | None = None


class FunctionCall(OpenAIModel):
    """A function call: its name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(OpenAIModel):
    """A tool call of an assistant message (request) or of a reply (response)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    """One message of a conversation; an assistant's may hold tool calls, a tool's answers one of them."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: Name | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(OpenAIModel):
    """A function the model may call: name, description and the JSON schema of its arguments."""

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIModel):
    """`tools[i]` of a chat request: only functions."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    """`tool_choice` naming the one function to call."""

    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Count | None = Field(None, description="Deprecated by OpenAI for max_completion_tokens.")
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_COUNT)  # the engine's decoding.max_logprobs bounds it
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's chat extras
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # the model processor's call, over model.mm_processor_kwargs
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class PromptLogprob(OpenAIModel):
    """vLLM's `prompt_logprobs` entry: one token's logprob at a prompt position, its rank and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# per prompt position (None for the first, which nothing predicts): token id -> its logprob; the prompt's own
# token and the top `prompt_logprobs`
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class ChatTopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIModel):
    content: list[ChatLogprob] | None = None


class ChatResponseMessage(OpenAIModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # vLLM's field for the reasoning of a reasoning model
    tool_calls: list[ToolCall] | None = None


class DeltaFunctionCall(OpenAIModel):
    name: str | None = None
    arguments: str = ""

    @model_serializer(mode="wrap")
    def _without_none(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaToolCall(OpenAIModel):
    """A streamed piece of a tool call: id, type and name on its first chunk, then argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _without_none(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatCompletionChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or token id that ended the choice


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, with the request's prompt_logprobs


class DeltaMessage(OpenAIModel):
    """What a stream chunk adds to a choice's message; unset fields are left out of the JSON."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _without_none(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatCompletionStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# --- /v1/completions ----------------------------------------------------------------------------


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] | None = None  # this or prompt_embeds, or both
    # vLLM's: base64 of torch.save'd [num_tokens, hidden_size] tensors (--enable-prompt-embeds); before `prompt`'s
    prompt_embeds: str | list[str] | None = None
    max_tokens: int | None = Field(16, ge=0, le=MAX_COUNT)  # 0: only with echo (the prompt alone, for scoring)
    logprobs: int | None = Field(None, ge=0, le=MAX_COUNT)  # the engine's decoding.max_logprobs bounds it
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_COUNT)


class CompletionLogprobs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, with prompt_logprobs (or echo with logprobs)


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# --- /v1/responses ------------------------------------------------------------------------------


class ResponsesContentPart(OpenAIModel):
    """A part of an input message: input_text (or output_text, in an earlier assistant turn), or input_image
    (`image_url`: a URL as in chat; `file_id` is refused: this server stores no files)."""

    type: str
    text: str | None = None
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] | None = None


class ResponsesInputMessage(OpenAIModel):
    """An input message."""

    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ResponsesContentPart]


class ResponsesFunctionCall(OpenAIModel):
    """A function call the model made earlier (an input item), or makes now (an output item)."""

    type: Literal["function_call"] = "function_call"
    id: str | None = None
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ResponsesFunctionCallOutput(OpenAIModel):
    """The result of a function call, sent back as an input item."""

    type: Literal["function_call_output"]
    call_id: str
    output: str


class ResponsesTool(OpenAIModel):
    """`tools[i]` of a responses request: only functions (the flat form of the Responses API)."""

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedToolChoice(OpenAIModel):
    type: Literal["function"]
    name: str


class ResponsesTextFormat(OpenAIModel):
    """`text.format`: as chat's response_format, with the json_schema fields inline."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponsesTextConfig(OpenAIModel):
    format: ResponsesTextFormat | None = None


class ResponsesRequest(OpenAIModel):
    """POST /v1/responses (text in, text out)."""

    model: Name | None = None
    input: str | list[ResponsesInputMessage | ResponsesFunctionCall | ResponsesFunctionCallOutput]
    instructions: str | None = None
    max_output_tokens: Count | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_COUNT)  # the engine's decoding.max_logprobs bounds it
    stream: bool = False
    store: bool | None = None
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None  # OpenAI's limits
    previous_response_id: Name | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedToolChoice | None = None
    parallel_tool_calls: bool = True
    text: ResponsesTextConfig | None = None
    user: Name | None = None
    # vLLM's extra sampling fields
    seed: Seed | None = None
    top_k: int | None = Field(None, ge=-1, le=MAX_COUNT)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stop: Stop | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=MAX_COUNT)
    priority: Priority = 0


class ResponsesTopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ResponsesLogprob(ResponsesTopLogprob):
    top_logprobs: list[ResponsesTopLogprob] = Field(default_factory=list)


class OutputText(OpenAIModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ResponsesLogprob] | None = None


class OutputMessage(OpenAIModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class ReasoningText(OpenAIModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(OpenAIModel):
    """The model's reasoning, an output item before its answer."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class InputTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(OpenAIModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(OpenAIModel):
    """The `response` object of the Responses API."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[ReasoningItem | OutputMessage | ResponsesFunctionCall]
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: str | ResponsesNamedToolChoice = "none"
    tools: list[ResponsesTool] = Field(default_factory=list)
    store: bool = False
    metadata: dict[str, str] | None = None
    usage: ResponseUsage | None = None


# --- errors -------------------------------------------------------------------------------------


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIModel):
    """OpenAI's error body, with every 4xx and 5xx answer."""

    error: ErrorInfo


# --- /v1/models ---------------------------------------------------------------------------------


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "llmplug"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(OpenAIModel):
    """POST /v1/load_lora_adapter (vLLM's runtime adapter loading)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(OpenAIModel):
    """POST /v1/unload_lora_adapter."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # accepted for vLLM's clients; the name decides


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
