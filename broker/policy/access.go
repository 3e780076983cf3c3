package policy

import apiv1 "github.com/tokenbroker/tokenbroker/api/v1"

// GatewayGrants counts the grants with access gateway: a broker that runs
// no lease gateway answers their requests 422, which its start and
// "config validate" say beforehand.
func (p *Policy) GatewayGrants() int {
	n := 0
	for _, peer := range p.Peers {
		for _, g := range peer.Grants {
			if g.Access == apiv1.AccessGateway {
				n++
			}
		}
	}
	return n
}
