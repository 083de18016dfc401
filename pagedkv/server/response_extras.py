"""What vLLM's request fields add to an answer (`http/request_fields.py` says which does what):
the response id, `system_fingerprint`, token ids with `return_token_ids`, empty text with
`detokenize: false`, and chat's echoed last message and rendered prompt (`return_prompt_text`)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.http.request_fields import VllmRequestFields, response_id


@dataclass(frozen=True)
class ResponseExtras:
    """Per request; read-only while the answer is written. `prompt_token_ids` is one list per
    prompt, set only when the request asked for `return_token_ids`; `prompt_text` (chat's
    rendered prompt) only when it asked for `return_prompt_text`."""

    id: str
    fingerprint: str | None
    prompt_token_ids: list[list[int]] | None
    detokenize: bool
    echo: str = ""
    prompt_text: str | None = None

    @classmethod
    def of(cls, req: VllmRequestFields, prefix: str, header_request_id: str | None,
           engine_request_id: str, fingerprint: str | None, prompts: list[list[int]],
           echo: str = "", prompt_text: str | None = None) -> ResponseExtras:
        return cls(response_id(prefix, req, header_request_id, engine_request_id), fingerprint,
                   prompts if req.return_token_ids else None, req.detokenize, echo, prompt_text)

    def text(self, text: str) -> str:
        """`text` as the answer carries it (empty with `detokenize: false`)."""
        return text if self.detokenize else ""

    def token_ids(self, ids: list[int]) -> list[int] | None:
        """Output token ids for the answer (None unless `return_token_ids`)."""
        return None if self.prompt_token_ids is None else list(ids)

    def prompt_ids(self, index: int = 0) -> list[int] | None:
        """Prompt `index`'s token ids for the answer (None unless `return_token_ids`)."""
        return None if self.prompt_token_ids is None else self.prompt_token_ids[index]
