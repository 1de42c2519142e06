"""TEST DOUBLE of ``kernelagent_oink.blackwell`` (not Oink)."""
