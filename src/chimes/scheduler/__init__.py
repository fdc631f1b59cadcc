"""The scheduler node: partition leases, the due scan, the timer wheel, firing, and the reaper."""
