"""OpenAI API request and response models (pydantic), with vLLM's extra sampling fields.

Requests are validated strictly: a string where a number belongs, a fractional float where an
integer belongs, or a value out of its bounds is a 400 (see `errors.py`), never a coercion or a
500. Two leniencies, as vLLM has them: `null` means the field's default (OpenAI clients send it
for unset fields), and an integral float is accepted as an integer (`max_tokens: 2.0`). A field
vLLM defines are declared (`request_fields.py`: honoured or documented no-ops); a top-level
field nobody defines is ignored with a logged warning, as vLLM does (a 400 naming it with
`--strict-request-fields`). The bounds mirror `SamplingParams`.
"""

from __future__ import annotations

import time
import types
import typing
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from pagedkv.http.request_fields import VllmRequestFields
from pagedkv.sched.validation import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 256  # the KV cache check (`check_fits`) usually says no long before this
MAX_LOGPROBS = 20

# The capped list fields of SamplingFields and their caps (validation.py).
LIST_CAPS = {"stop": MAX_STOP_STRINGS, "stop_token_ids": MAX_STOP_TOKEN_IDS,
             "bad_words": MAX_BAD_WORDS, "logit_bias": MAX_LOGIT_BIAS,
             "allowed_token_ids": MAX_ALLOWED_TOKEN_IDS}

TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
NonEmptyStr = Annotated[str, Field(min_length=1)]


def _wants_int(annotation: Any) -> bool:
    """True when `annotation` admits an int but no float (through Optional / Annotated)."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _wants_int(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        arms = typing.get_args(annotation)
        return float not in arms and any(_wants_int(a) for a in arms)
    return annotation is int


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """Drop `null` fields (so they take their defaults) and turn integral floats into
        ints where only an int belongs; everything else is left to strict validation."""
        if not isinstance(data, dict):
            return data
        out = {}
        for key, value in data.items():
            if value is None:
                continue
            field = cls.model_fields.get(key)
            if (isinstance(value, float) and value.is_integer() and field is not None
                    and _wants_int(field.annotation)):
                value = int(value)
            out[key] = value
        return out


class StreamOptions(_Request):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far
    continuous_usage_stats: bool = False

    def usage_flags(self) -> tuple[bool, bool]:
        """(a final usage chunk, usage on every chunk), as vLLM's `should_include_usage`."""
        return self.include_usage, self.include_usage and self.continuous_usage_stats


def usage_flags(options: StreamOptions | None) -> tuple[bool, bool]:
    """`StreamOptions.usage_flags` of a request's (possibly absent) stream_options."""
    return options.usage_flags() if options is not None else (False, False)


class JsonSchemaFormat(_Request):
    """OpenAI's `response_format.json_schema`."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's `response_format`: text (no constraint), json_object, or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Request):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(None, description="the served model name (default: it)")
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # vLLM's extras.
    top_k: int = Field(0, ge=-1, le=2**31 - 1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=2**31 - 1)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    cache_salt: NonEmptyStr | None = None
    return_tokens_as_token_ids: bool = Field(
        False, description="write logprobs tokens as 'token_id:<id>' (vLLM's extension)")
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS,
        description="vLLM's extension: the top-N logprobs of every prompt token, returned as "
                    "`prompt_logprobs` (the request then gets no prefix-cache hit)")
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, and vLLM's
    # older guided_* spellings (at most one kind of constraint per request).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    # Token-level controls (OpenAI's logit_bias; vLLM's allowed_token_ids, bad_words,
    # truncate_prompt_tokens: keep only the prompt's last N tokens, -1 = max_model_len).
    # Each list is capped (validation.py; the text lists' bytes by SamplingParams, a 400 too).
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1,
                                                      max_length=MAX_ALLOWED_TOKEN_IDS)] | None = None
    bad_words: Annotated[list[NonEmptyStr], Field(max_length=MAX_BAD_WORDS)] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=2**31 - 1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)

    @field_validator(*LIST_CAPS, mode="before")
    @classmethod
    def _count_before_items(cls, value: Any, info: ValidationInfo) -> Any:
        """A capped list past its cap is refused before any of its items is validated (a
        500,000-entry list costs a length check, not 500,000 validations)."""
        cap = LIST_CAPS[info.field_name]
        if isinstance(value, (list, dict)) and len(value) > cap:
            raise ValueError(f"{info.field_name} has {len(value)} entries, more than the "
                             f"limit of {cap}")
        return value


Prompt = (
    str
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[str], Field(min_length=1)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
)


class KVTransferParams(BaseModel):
    """vLLM's `kv_transfer_params` of prefill/decode disaggregation, with pagedkv's own keys
    under the same object (pagedkv/server/kv_transfer.py says what each does). Keys other
    connectors add are ignored; a declared key of the wrong type is a 400."""

    model_config = ConfigDict(strict=True, extra="ignore")

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[int] | list[list[int]] | None = None
    remote_host: str | None = None
    remote_port: int | None = Field(None, ge=0, le=65535)
    tp_size: int | None = None
    transport: str | None = None
    block_hashes: list[str] | None = None
    num_tokens: int | None = Field(None, ge=0)
    num_blocks: int | None = Field(None, ge=0)
    block_size: int | None = None
    model_identity: str | None = None
    kv_format: str | None = None
    cache_salt: str | None = None


class KVTransferField(BaseModel):
    """The request field of prefill/decode disaggregation (completions and chat)."""

    kv_transfer_params: KVTransferParams | None = None


class CompletionRequest(SamplingFields, VllmRequestFields, KVTransferField):
    """POST /v1/completions. `prompt`: a string, a token-id list, or a list of either."""

    prompt: Prompt
    # 0 only with `echo` (score the prompt, generate nothing), as lm-evaluation-harness asks.
    max_tokens: int | None = Field(None, ge=0, le=INT64_MAX)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: None = None


class TextContentPart(_Request):
    """A text part; other keys (e.g. a client's `cache_control`) are ignored, as vLLM does."""

    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str


class ToolCall(_Request):
    """A tool call, as an assistant message carries it (request and response)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    """A chat message. Keys it does not declare are ignored, as vLLM's message dicts allow: an
    assistant message sent back as the SDK returned it carries `refusal`, `annotations`,
    `audio`, `reasoning`... (a bad value of a declared key is still a 400)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(_Request):
    name: NonEmptyStr
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: NonEmptyStr


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields, VllmRequestFields, KVTransferField):
    """POST /v1/chat/completions. `echo`: the answer starts with the last message's content
    when that message is the assistant's (vLLM's meaning)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    echo: bool = False
    return_prompt_text: bool | None = None  # vLLM's: the answer carries the rendered prompt


# ---- responses ------------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: None = None  # vLLM's reasoning-token count: no reasoning parser


class VllmResponseFields(BaseModel):
    """The top-level keys vLLM 0.32 puts in every completions and chat answer, with the values
    they have here: the tier that served it (none: one tier), KV and encoder-cache transfer
    parameters (no encoder cache) and per-request metrics (vLLM sets
    them only when its server is asked to). `kv_transfer_params`: a prefill's handoff to its
    decode (prefill/decode disaggregation), else None."""

    service_tier: None = None
    kv_transfer_params: dict | None = None
    ec_transfer_params: None = None
    metrics: None = None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions logprobs: parallel lists, one entry per output token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's `Logprob` as its server writes `prompt_logprobs` entries (keyed by token id)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    token_ids: list[int] | None = None  # with return_token_ids
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    routed_experts: None = None  # vLLM's MoE routing record (off unless its server enables it)


class CompletionResponse(VllmResponseFields):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    """As vLLM writes it: OpenAI's `refusal`, `annotations`, `audio`, `function_call` (all
    null: nothing here produces them) and vLLM's `reasoning` (null: no reasoning parser);
    `tool_calls` only when there are some."""

    role: Literal["assistant"] = "assistant"
    content: str | None = ""
    refusal: None = None
    annotations: None = None
    audio: None = None
    function_call: None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning: None = None

    @model_serializer(mode="wrap")
    def _drop_empty_tool_calls(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
        return data


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed piece of tool call `index`: the first carries id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids
    routed_experts: None = None  # as CompletionChoice's


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids: this chunk's tokens


class ChatCompletionResponse(VllmResponseFields):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    prompt_text: str | None = None  # the rendered chat prompt, with return_prompt_text


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids: each role chunk
    prompt_text: str | None = None  # with return_prompt_text: each role chunk


class ModelPermission(BaseModel):
    """vLLM's (and OpenAI's former) permission entry of a model card: fixed values."""

    id: str = Field(default_factory=lambda: f"modelperm-{uuid.uuid4().hex}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=_now)
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "pagedkv"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    vocab_size: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- vLLM's /tokenize and /detokenize ----------------------------------------------------


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class PinRequest(_Request):
    """pagedkv's POST /v1/pin and /v1/unpin: a prompt (text, tokenized as /v1/completions does,
    or token ids) and the `cache_salt` its requests use."""

    model: str | None = None
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
    cache_salt: NonEmptyStr | None = None


class PinResponse(BaseModel):
    """`pagedkv.kv.pins.PinInfo`: the pin's id, blocks and tokens it holds (0 after an unpin),
    the prompt's full blocks, and the blocks pinned in all."""

    pin_id: str
    num_blocks: int
    num_tokens: int
    num_prompt_blocks: int
    total_pinned_blocks: int
