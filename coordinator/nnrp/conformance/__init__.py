"""openai-compatible/1 conformance: readable JSON recipes (``recipes/``) and the runner that selects
them by a server's capability manifest and runs them over an NNRP session (``docs/nnrp.md``)."""

from coordinator.nnrp.conformance.recipes import Recipe, RecipeError, load_recipes, why_not_selected

__all__ = ["Recipe", "RecipeError", "load_recipes", "why_not_selected"]
