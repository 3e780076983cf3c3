package server

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/clock"

	"github.com/tokenbroker/tokenbroker/broker"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/enrollment"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/issuers/leasecert"
	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/server/gateway"
)

// gatewayParts are the lease gateway's pieces that Run wires: the
// gateway, its TLS profile, and what the broker needs to issue its leases.
type gatewayParts struct {
	gateway *gateway.Gateway
	tls     *tls.Config
	broker  *broker.Gateway
}

// brokerConfig is the broker's Gateway, nil without a gateway.
func (g *gatewayParts) brokerConfig() *broker.Gateway {
	if g == nil {
		return nil
	}
	return g.broker
}

// newGateway builds the lease gateway of opts: lease certificates from the
// signing CA, verified at the gateway against it and the previous CA
// only; requests forwarded with tokens of the lease's ServiceAccount bound
// to the lease Secret; connections ended as the lease counter sees a
// lease go.
func newGateway(opts Options, client kubernetes.Interface, leases *lease.Counter, deny gateway.DenyList, auditor audit.Auditor,
	reg prometheus.Registerer, log *zap.Logger, signing *pki.CAReloader, previous enrollment.CACertificates,
	sources func() enrollment.PublishSources, certs *pki.CertReloader) (*gatewayParts, error) {
	upstream, plain, upgrade, err := gateway.NewTransports(kubeRESTConfig(opts, log))
	if err != nil {
		return nil, err
	}
	m, err := gateway.NewMetrics(reg)
	if err != nil {
		return nil, fmt.Errorf("register gateway metrics: %w", err)
	}
	tokens := &gateway.Tokens{SA: client.CoreV1()}
	g, err := gateway.New(gateway.Config{
		Upstream: upstream, Transport: plain, UpgradeTransport: upgrade,
		Tokens: tokens.Token, Leases: leases, Deny: deny, Auditor: auditor, Metrics: m,
		Logger: log.Named("gateway"), Clock: clock.RealClock{},
		MaxConnsPerLease: opts.GatewayMaxConnsPerLease, MaxConnsPerPeer: opts.GatewayMaxConnsPerPeer,
		MaxRequestsPerLease: opts.GatewayMaxRequestsPerLease, MaxRequestsPerPeer: opts.GatewayMaxRequestsPerPeer,
	})
	if err != nil {
		return nil, err
	}
	leases.OnGone(g.Gone)
	// Pinned: the signing CA and the previous one verify lease
	// certificates, no other CA of the bundle.
	roots := func() *x509.CertPool {
		p := x509.NewCertPool()
		p.AddCert(signing.Certificate())
		if previous != nil {
			for _, c := range previous.Certificates() {
				p.AddCert(c)
			}
		}
		return p
	}
	// A gateway kubeconfig trusts the CAs that anchor the serving
	// certificate, as a published ClusterTrustBundle does: never the
	// whole bundle, whose partner CAs could issue a certificate for the
	// gateway's name. Worked out at most every caDataEvery, not per
	// issuance.
	caData := cachedCAData(func() []byte {
		if cas, ok := enrollment.PublishedCAs(sources(), time.Now()); ok {
			return pki.EncodeCertificatesPEM(cas)
		}
		return nil
	})
	if len(caData()) == 0 {
		return nil, fmt.Errorf("--gateway-address: the serving certificate (--tls-cert-file) does not verify to any of the operator's CAs (--client-ca-file, --ca-cert-file, --previous-ca-cert-file), so gateway kubeconfigs would have no CA to trust it with")
	}
	return &gatewayParts{
		gateway: g,
		tls:     pki.GatewayTLSConfig(certs, roots, time.Now),
		broker: &broker.Gateway{
			Issuer: &leasecert.Issuer{Signer: signing},
			Server: opts.GatewayURL,
			CAData: caData,
		},
	}, nil
}

// caDataEvery is how long the gateway's CA bundle is reused before it is
// worked out again (the serving certificate and CA files reload).
const caDataEvery = 10 * time.Second

// cachedCAData returns f's answer, worked out again at most every
// caDataEvery.
func cachedCAData(f func() []byte) func() []byte {
	var (
		mu   sync.Mutex
		last []byte
		at   time.Time
	)
	return func() []byte {
		mu.Lock()
		defer mu.Unlock()
		if at.IsZero() || time.Since(at) > caDataEvery {
			last, at = f(), time.Now()
		}
		return last
	}
}
