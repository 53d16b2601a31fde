"""vLLM behind one adapter: engine arguments, placement and data-parallel ranks, the generation, pooling and
scoring engines, response bodies, reasoning and tool-call parsers. Imports the layers below; no Dagster."""
