"""The fixed texts an agreement record scores and continues: every record uses the same ones, so two records
of one model line up position by position. They mix prose, lists, code, arithmetic, dialogue and another
language, so that confident and uncertain positions both occur."""

from __future__ import annotations

PROMPTS: tuple[str, ...] = (
    "The water cycle begins when the sun warms the surface of lakes and oceans. Water evaporates, rises as "
    "vapour, cools at altitude and condenses into clouds. When the droplets grow heavy enough,",
    "Here is a short list of things to pack for a weekend hiking trip:\n1. A waterproof jacket\n2.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n",
    "Question: A train leaves at 9:15 and arrives at 11:40. How long is the journey?\nAnswer:",
    "The French Revolution, which began in 1789, changed the political order of Europe. Its causes included",
    "User: Can you recommend a good way to learn a new language?\nAssistant:",
    "La ville de Lyon est connue pour sa cuisine et pour ses deux rivières, le Rhône et la Saône. Chaque année,",
    "SELECT name, COUNT(*) AS orders\nFROM customers JOIN orders ON customers.id = orders.customer_id\n",
    "Once upon a time, in a village at the edge of a great forest, there lived an old clockmaker who",
    "Photosynthesis converts light energy into chemical energy. In the first stage, the light-dependent "
    "reactions,",
    "To compute the area of a circle, multiply pi by the square of the radius. For a radius of 3 cm, the area is",
    "Dear hiring manager,\n\nI am writing to apply for the position of",
)
