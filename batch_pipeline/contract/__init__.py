"""The OpenAI Batch contract (docs/CONTRACT.md): request bodies, the line envelope, error codes, the Batch
object, the result lines, and the C fast path that accepts valid lines. Imports base/ and config/ only."""
