package pki

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"sync"
)

// Bootstrap is the TLS side of fetching a trust bundle before the client
// has one, pinned by the fingerprint of a CA in it (like `step ca
// bootstrap`). The handshake cannot verify the server yet, so Config
// records the server's chain; Verify then checks, before anything read
// over the connection is used, that the fetched bundle holds the pinned CA
// and that the recorded server chain verifies against that bundle for the
// host that was dialled. Verification is deferred, never skipped.
type Bootstrap struct {
	mu    sync.Mutex
	chain []*x509.Certificate
}

// Config returns the TLS 1.3 client profile for the bootstrap request.
func (b *Bootstrap) Config() *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		MaxVersion: tls.VersionTLS13,
		// The chain is verified by Verify against the pinned bundle before
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

// Verify returns nil iff bundlePEM holds a CA with the pinned fingerprint
// and the server chain recorded during the handshake verifies against
// bundlePEM as a server certificate for host (a DNS name or IP address).
func (b *Bootstrap) Verify(bundlePEM []byte, fingerprint, host string) error {
	if err := VerifyBundleFingerprint(bundlePEM, fingerprint); err != nil {
		return err
	}
	certs, err := ParseCertificatesPEM(bundlePEM)
	if err != nil {
		return fmt.Errorf("bootstrap: trust bundle: %w", err)
	}
	roots := x509.NewCertPool()
	for _, c := range certs {
		roots.AddCert(c)
	}
	b.mu.Lock()
	chain := b.chain
	b.mu.Unlock()
	if len(chain) == 0 {
		return errors.New("bootstrap: no server certificate was recorded")
	}
	inter := x509.NewCertPool()
	for _, c := range chain[1:] {
		inter.AddCert(c)
	}
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	_, err = chain[0].Verify(x509.VerifyOptions{
		DNSName:       host,
		Roots:         roots,
		Intermediates: inter,
		KeyUsages:     []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	})
	if err != nil {
		return fmt.Errorf("bootstrap: the broker's certificate does not chain to the pinned trust bundle: %w", err)
	}
	return nil
}
