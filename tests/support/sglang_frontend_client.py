"""An SGLang frontend program, run unchanged in the side env (tests.support.sglang_env) against a gateway:
`python sglang_frontend_client.py <base url>` (or `-`: the URL is read from stdin, so that the slow
`import sglang` can overlap the start of the services) prints one JSON object with what each part produced.

Only SGLang's public frontend API is used: RuntimeEndpoint, @sgl.function with sgl.user / sgl.assistant /
sgl.gen (free, dtype=int and regex), streaming through text_iter, sgl.select, flush_cache and get_server_info.
"""

import json
import sys

import sglang as sgl


@sgl.function
def chat(s, question):
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=12, temperature=0))


@sgl.function
def analysis(s, question):
    # The design document's program: a long answer (up to 1,024 tokens) to a prompt of ~130 tokens, which
    # needs a context longer than a KV slot per session ever gave.
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("analysis", max_tokens=1024, temperature=0.1))


ANALYSIS_QUESTION = (
    "Analyse the following Python function step by step. Explain what it computes, what its time and memory "
    "costs are, which inputs make it fail, and how you would rewrite it to be faster and clearer:\n\n"
    "def pairs(xs, target):\n"
    "    out = []\n"
    "    for i in range(len(xs)):\n"
    "        for j in range(len(xs)):\n"
    "            if i != j and xs[i] + xs[j] == target and (xs[j], xs[i]) not in out:\n"
    "                out.append((xs[i], xs[j]))\n"
    "    return sorted(out)\n"
)


@sgl.function
def constrained(s):
    s += "x = " + sgl.gen("number", dtype=int, max_tokens=6, temperature=0)
    s += "\nok = " + sgl.gen("flag", regex="(yes|no)", max_tokens=4, temperature=0)


@sgl.function
def pick(s, prefix, choices):
    s += prefix + sgl.select("choice", choices=choices)


def main(url: str) -> None:
    backend = sgl.RuntimeEndpoint(url)
    sgl.set_default_backend(backend)
    out: dict = {"model": backend.get_model_name()}

    state = chat.run(question="Write a function that adds two numbers.")
    out["answer"] = state["answer"]
    out["text"] = state.text()
    out["answer_meta"] = state.get_meta_info("answer")

    streamed = chat.run(question="Write a function that adds two numbers.", stream=True)
    out["stream_pieces"] = list(streamed.text_iter("answer"))
    out["stream_answer"] = streamed["answer"]

    state = analysis.run(question=ANALYSIS_QUESTION)
    out["analysis"] = state["analysis"]
    out["analysis_meta"] = state.get_meta_info("analysis")
    streamed = analysis.run(question=ANALYSIS_QUESTION, stream=True)
    out["analysis_stream_pieces"] = list(streamed.text_iter("analysis"))
    out["analysis_stream"] = streamed["analysis"]

    state = constrained.run()
    out["number"], out["flag"] = state["number"], state["flag"]

    choices = ["def", "import", "class"]
    prefix = "x = 1\n"
    state = pick.run(prefix=prefix, choices=choices)
    out["select"] = {"prefix": prefix, "choices": choices, "choice": state["choice"]}
    out["select_meta"] = state.get_meta_info("choice")

    sgl.flush_cache()
    out["server_info"] = sgl.get_server_info()
    print(json.dumps(out, default=repr))


if __name__ == "__main__":
    main(sys.stdin.readline().strip() if sys.argv[1] == "-" else sys.argv[1])
