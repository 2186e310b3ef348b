"""Calls to the gateway's REST front in tests: plain HTTP for what the openai client would never send, and
streamed replies that ask for usage."""

import json
import urllib.error
import urllib.request


class Reply:
    def __init__(self, status, body):
        self.status_code, self._body = status, body

    def json(self):
        return json.loads(self._body)


def http(method, url, body: bytes | None = None, json_body=None) -> Reply:
    """A plain HTTP call (stdlib only), for requests the openai client would never send."""
    if json_body is not None:
        body = json.dumps(json_body).encode()
    req = urllib.request.Request(url, data=body, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return Reply(r.status, r.read())
    except urllib.error.HTTPError as e:
        return Reply(e.code, e.read())


def stream_with_usage(create, **kw):
    """A streamed completion or chat reply (`create`: the openai client's) that asks for usage in its last
    chunk: the stream of its chunks."""
    return create(stream=True, stream_options={"include_usage": True}, **kw)


def greedy_stream(client, prompt, max_tokens: int, **extra_body):
    """A streamed greedy completion of `prompt` through the openai `client` that asks for usage in its last
    chunk (`extra_body`: vLLM's extras, session_id): the stream of its chunks."""
    return stream_with_usage(
        client.completions.create,
        model="demo",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body=extra_body,
    )
