"""OpenAI's API: GET /v1/models, GET /v1/models/{id}, POST /v1/completions,
/v1/chat/completions and /v1/responses (serving_completion.py, serving_chat.py,
serving_responses.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagedkv.http.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from pagedkv.server.responses_protocol import ResponsesRequest
from pagedkv.server.routes import ERROR_RESPONSES
from pagedkv.server.serving_chat import create_chat_completion
from pagedkv.server.serving_completion import create_completion
from pagedkv.server.serving_responses import create_response

router = APIRouter()


def model_card(raw: Request) -> ModelCard:
    """The one model this server serves, as OpenAI's model list shows it."""
    serving, facts = raw.app.state.serving, raw.app.state.engine_facts
    vocab = facts.ready.vocab_size or getattr(serving.tokenizer, "vocab_size", None)
    return ModelCard(id=serving.model_name, root=facts.args.model,
                     max_model_len=serving.max_model_len,
                     vocab_size=vocab if isinstance(vocab, int) else None)


@router.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
async def models(raw: Request) -> ModelList:
    return ModelList(data=[model_card(raw)])


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERROR_RESPONSES)
async def model(model_id: str, raw: Request) -> ModelCard:
    raw.app.state.serving.check_model(model_id)
    return model_card(raw)


@router.post("/v1/completions", responses=ERROR_RESPONSES)
async def completions(body: CompletionRequest, raw: Request) -> Response:
    return await create_completion(raw.app.state.serving, body, raw)


@router.post("/v1/chat/completions", responses=ERROR_RESPONSES)
async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
    return await create_chat_completion(raw.app.state.serving, body, raw)


@router.post("/v1/responses", responses=ERROR_RESPONSES)
async def responses(body: ResponsesRequest, raw: Request) -> Response:
    """OpenAI's Responses API, text in and out (serving_responses.py)."""
    return await create_response(raw.app.state.serving, body, raw)
