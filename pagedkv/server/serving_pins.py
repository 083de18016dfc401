"""pagedkv's POST /v1/pin and POST /v1/unpin: pinned prefixes over HTTP.

A pin runs the prompt first when its full blocks are not all cached (one generated token),
then holds them in the device prefix cache until unpinned (`AsyncEngine.pin_prefix`). Prompts
are tokenized as /v1/completions tokenizes them (special tokens added), so a pinned prompt is
exactly the prefix its completions requests hit. Errors: 400 for a bad body, a prompt without
a full block or past `max_pinned_fraction`; 404 for an unpin of a prompt that is not pinned;
503 while the engine cannot serve.
"""

from __future__ import annotations

from pagedkv.engine.async_engine import EngineDeadError
from pagedkv.http.errors import APIError
from pagedkv.http.protocol import PinRequest, PinResponse
from pagedkv.kv.pins import NotPinnedError
from pagedkv.server.serving import OpenAIServing


async def _prompt_ids(serving: OpenAIServing, req: PinRequest) -> list[int]:
    if isinstance(req.prompt, str):
        return await serving.run_tokenizer(lambda: serving.encode_prompt(
            req.prompt, add_special_tokens=True))
    return list(req.prompt)


async def pin(serving: OpenAIServing, req: PinRequest, *, unpin: bool = False) -> PinResponse:
    """Pin (or, with `unpin`, release) the prefix of `req.prompt` salted with `req.cache_salt`."""
    serving.check_model(req.model)
    ids = await _prompt_ids(serving, req)
    engine = serving.engine
    try:
        info = await (engine.unpin_prefix(ids, req.cache_salt) if unpin
                      else engine.pin_prefix(ids, req.cache_salt))
    except NotPinnedError as exc:
        raise APIError(str(exc), status_code=404, param="prompt") from exc
    except ValueError as exc:
        raise APIError(str(exc), param="prompt") from exc
    except EngineDeadError as exc:
        raise APIError(str(exc), status_code=503, type="server_unavailable") from exc
    return PinResponse(**info.to_dict())
