"""The prompts every benchmark here uses, so engines are compared on the same text."""

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how photosynthesis works to a ten year old.",
    "What are the main causes of the French Revolution?",
    "Give me three tips for writing clean Python code.",
    "Describe the water cycle in a few sentences.",
    "Why is the sky blue? Answer briefly.",
    "List some healthy breakfast ideas.",
    "What is the difference between a virus and a bacterium?",
]
