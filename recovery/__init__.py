"""Recovery: parallel-layout planner, command rewriting, checkpoint discovery."""
