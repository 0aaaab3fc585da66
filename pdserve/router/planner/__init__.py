"""The SLO planner: its rule over one window of figures, the loop in the router, and its predictions of each layout."""
