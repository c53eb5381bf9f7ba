from django.db import models


class Order(models.Model):
    customer = models.CharField(max_length=100)
    amount_cents = models.IntegerField()
    #: unpaid, then paid (by the customer) or closed (by its ax task)
    status = models.CharField(max_length=10, default="unpaid")

    class Meta:
        app_label = "shop"
        db_table = "shop_order"
