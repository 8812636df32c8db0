"""eyas.spec"""
