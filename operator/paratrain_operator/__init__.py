"""The paratrain operator: kopf handlers over a pure planner and renderer (spec → gang objects)."""
