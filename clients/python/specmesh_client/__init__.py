"""specmesh-client: a typed client for specmesh.v1.GatewayService (and, in `specmesh.v1`, the raw stubs).

from specmesh_client import SpecmeshClient

with SpecmeshClient("127.0.0.1:50070") as client:
    reply = client.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=32, temperature=0)
    print(reply.text, reply.finish_reason, reply.usage)
    for chunk in client.generate_stream("def main():\n", max_tokens=32, session_id="s1"):
        print(chunk.text, end="", flush=True)
"""

from specmesh_client.client import (
    Chunk,
    Generation,
    Message,
    SpecmeshClient,
    SpecStats,
    SpeculativeDecoding,
    Usage,
)

__all__ = ["Chunk", "Generation", "Message", "SpecStats", "SpecmeshClient", "SpeculativeDecoding", "Usage"]
__version__ = "0.1.0"
