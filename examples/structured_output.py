"""Structured outputs: a JSON schema, a choice list and a regex, enforced token by token.

    python examples/structured_output.py                   # the bundled SmolLM2 model
    python examples/structured_output.py --model random    # even random weights give valid JSON

Over HTTP the same constraints go in `response_format` (json_schema) or vLLM's
`structured_outputs` field, e.g.
    curl localhost:8000/v1/chat/completions -d '{"model": "smollm2", "messages": [...],
         "structured_outputs": {"choice": ["yes", "no"]}}'
"""

from __future__ import annotations

import argparse
import json

from common import resolve_model

from pagedkv import LLM, SamplingParams, StructuredOutputsParams

CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 50},
    },
    "required": ["city", "country", "population_millions"],
    "additionalProperties": False,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="path, .gguf, HF id, or 'random'")
    args = parser.parse_args()
    llm = LLM(model=resolve_model(args.model))

    def ask(prompt: str, constraint: StructuredOutputsParams) -> str:
        params = SamplingParams(temperature=0.0, max_tokens=96, structured_outputs=constraint)
        return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text

    text = ask("Describe Paris as JSON with city, country and population in millions: ",
               StructuredOutputsParams(json=CITY_SCHEMA))
    print("json  :", text, "->", json.loads(text))
    print("choice:", ask("Is the sky blue? Answer yes or no: ",
                         StructuredOutputsParams(choice=["yes", "no"])))
    print("regex :", ask("A date in ISO format: ",
                         StructuredOutputsParams(regex=r"20[0-9]{2}-[01][0-9]-[0-3][0-9]")))
    llm.shutdown()


if __name__ == "__main__":
    main()
