"""Runnable recipes: ``python -m edurl.recipes.NAME --field value ...``; ``--help`` lists the fields."""
