"""eyas.gpu"""
