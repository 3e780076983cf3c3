package pki

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"
)

// Bootstrap is the TLS side of fetching a trust bundle before the client
// has one, pinned by the fingerprint of a CA in it (like `step ca
// bootstrap`). The handshake cannot verify the server yet, so Config
// records the server's chain; Verify then checks, before anything read
// over the connection is used, that the fetched bundle holds the pinned CA
// and that the recorded server chain verifies, for the host that was
// dialled, with the pinned CA as its only root. Verification is deferred,
// never skipped.
//
// The pinned CA alone is the anchor: whoever answers the bootstrap request
// chooses the bundle, so a bundle holding the operators' CA and another
// one proves nothing about the other one. Other bundle certificates may
// only be intermediates under the pinned CA.
type Bootstrap struct {
	// Now is the clock for certificate validity; nil means time.Now.
	Now func() time.Time

	mu    sync.Mutex
	chain []*x509.Certificate
}

// Config returns the TLS 1.3 client profile for the bootstrap request.
func (b *Bootstrap) Config() *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		MaxVersion: tls.VersionTLS13,
		// The chain is verified by Verify against the pinned CA before
		// the answer is trusted; see the type's doc.
		InsecureSkipVerify: true, //nolint:gosec // verified after the bundle is fetched, by Verify
		VerifyConnection: func(cs tls.ConnectionState) error {
			if len(cs.PeerCertificates) == 0 {
				return errors.New("bootstrap: the server sent no certificate")
			}
			b.mu.Lock()
			defer b.mu.Unlock()
			b.chain = cs.PeerCertificates
			return nil
		},
	}
}

// Verify checks that bundlePEM holds a CA with the pinned fingerprint and
// that the server chain recorded during the handshake verifies as a server
// certificate for host (a DNS name or IP address) with that CA as the only
// root; the other certificates of the bundle and of the chain may only be
// intermediates. It returns the trust to keep, as PEM: the pinned CA and
// the bundle's CAs that chain to it (see PinnedBundle), never the bundle
// as served.
func (b *Bootstrap) Verify(bundlePEM []byte, fingerprint, host string) ([]byte, error) {
	now := time.Now()
	if b.Now != nil {
		now = b.Now()
	}
	trusted, err := PinnedBundle(bundlePEM, fingerprint, now)
	if err != nil {
		return nil, err
	}
	all, err := ParseCertificatesPEM(bundlePEM)
	if err != nil {
		return nil, fmt.Errorf("bootstrap: trust bundle: %w", err)
	}
	roots := x509.NewCertPool()
	roots.AddCert(trusted[0])
	b.mu.Lock()
	chain := b.chain
	b.mu.Unlock()
	if len(chain) == 0 {
		return nil, errors.New("bootstrap: no server certificate was recorded")
	}
	inter := x509.NewCertPool()
	for _, c := range chain[1:] {
		inter.AddCert(c)
	}
	for _, c := range all {
		inter.AddCert(c)
	}
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	_, err = chain[0].Verify(x509.VerifyOptions{
		DNSName:       host,
		Roots:         roots,
		Intermediates: inter,
		CurrentTime:   now,
		KeyUsages:     []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	})
	if err != nil {
		return nil, fmt.Errorf("bootstrap: the broker's certificate does not chain to the pinned CA: %w", err)
	}
	return encodeCerts(trusted), nil
}
