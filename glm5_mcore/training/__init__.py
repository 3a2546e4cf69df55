"""What the SFT recipe and the RL trainer share."""
