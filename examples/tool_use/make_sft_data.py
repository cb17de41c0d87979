"""Write tool-use SFT conversations for one model family: call ``add``/``multiply``, read the result, answer.

python examples/tool_use/make_sft_data.py runs/tool_use/qwen3/sft_data.jsonl --family qwen3 --n 256

Each row is ``{"messages": [...], "tools": [...]}`` (OpenAI shapes); ``areal-agents sft`` renders it through
the model's own chat template, so the model learns its family's call format. Problems come from the env's
train split, so RL's held-out evaluation stays held out. The prompts are those ``ToolAgent`` will pose: where
the template does not list tools itself (DeepSeek-R1's), a system message lists them, as the agent does.
"""

import argparse

from areal_agents.chat.parsers import ReplyParser
from areal_agents.data.jsonl import write_chat_jsonl
from areal_agents.data.tool_use import REASONING, tool_use_conversations, tools_for
from areal_agents.envs.base import hash_split
from areal_agents.envs.tools import tools_prompt
from areal_agents.models.families import get_family


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--family", required=True, choices=sorted(REASONING), help="the tiny model's family")
    parser.add_argument("--n", type=int, default=256, help="conversations")
    parser.add_argument("--digits", type=int, default=1)
    parser.add_argument("--operators", default="+", help="'+' (the add tool), '*' (multiply) or '+*' (both)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    tools = tools_for(args.operators)
    template = get_family(args.family).chat_template
    listed = "tools" in template  # ToolAgent's rule: the template lists them, else a system message in its format
    conversations = tool_use_conversations(
        args.n,
        seed=args.seed,
        reasoning=REASONING[args.family],
        digits=args.digits,
        operators=args.operators,
        keep=lambda problem: hash_split(problem) == "train",
        system=None if listed else tools_prompt(tools, ReplyParser.for_template(template).tool_parser),
    )
    n = write_chat_jsonl(args.out, conversations, tools=tools)
    print(f"{n} {args.family} tool-use conversations written to {args.out}")


if __name__ == "__main__":
    main()
