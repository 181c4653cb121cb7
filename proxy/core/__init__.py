"""The sans-IO core: bytes and facts in, events, verdicts and replies out.

The SSE reader, the dialects, the stream guard and the whole-body judge, the lifecycle (every
transition of one exchange in one table), token latency, header and request-target rules, the
exchange record. Nothing here imports asyncio, aiohttp or anything of the package outside `proxy.core`:
it is tested by feeding bytes at every split, and the I/O code only carries out its answers.
"""
