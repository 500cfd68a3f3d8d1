"""SpecPilot dashboard: a Streamlit multipage app (presentation only; data and decisions
come from ``control``). Start it with ``python -m dashboard``."""
