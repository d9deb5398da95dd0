"""Building blocks shared by every model family (one piece of code per idea)."""
