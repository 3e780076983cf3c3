package broker

import (
	"time"

	"github.com/tokenbroker/tokenbroker/broker/lease"
)

// leaseRules returns the rules of the policy in force
// (tenants.RulesCache), rebuilt only when the policy or the namespaces its
// selector grants match change.
func (b *Broker) leaseRules() *lease.Rules {
	var minTTL time.Duration
	for _, iss := range b.cfg.Issuers {
		minTTL = max(minTTL, iss.Limits().MinTTL)
	}
	return b.rules.Rules(b.cfg.Policy.Load(), b.tenants, minTTL)
}
