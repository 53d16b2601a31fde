"""The steps the assets call: validate, order, infer, write results, measure. Imports every layer below;
no Dagster (defs/ wires these steps into assets)."""
