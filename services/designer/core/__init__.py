"""Pure domain logic of the designer: skills, prompts, output parsing, attempts and the loop."""
