"""The speculation autopilot: picks how many draft tokens to propose, step by step."""
