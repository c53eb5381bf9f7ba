from typing import ClassVar

from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    dependencies: ClassVar[list[tuple[str, str]]] = []
    operations: ClassVar[list[migrations.operations.base.Operation]] = [
        migrations.CreateModel(
            name="Order",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True,
                                           serialize=False, verbose_name="ID")),
                ("customer", models.CharField(max_length=100)),
                ("amount_cents", models.IntegerField()),
                ("status", models.CharField(default="unpaid", max_length=10)),
            ],
            options={"db_table": "shop_order"},
        ),
    ]
