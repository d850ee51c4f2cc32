"""Online detectors, step alignment, incidents, the detection service and offline replay."""
