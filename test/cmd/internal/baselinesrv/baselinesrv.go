// Package baselinesrv is what the bench's baselines (test/cmd/bareproxy
// and test/cmd/bareissuer) share: their serving certificate and client CA
// loaded from files, and an http.Server served on a TLS listener until
// the context ends.
package baselinesrv

import (
	"context"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/tokenbroker/tokenbroker/pki"
)

// Serve serves srv on ln until ctx ends, then shuts it down within 5 s.
// It returns nil after a clean shutdown.
func Serve(ctx context.Context, srv *http.Server, ln net.Listener) error {
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	shutdownCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutdownCtx); err != nil {
		return err
	}
	if err := <-errc; !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// Flags are the listener's flags every baseline takes.
type Flags struct {
	Listen       string
	CertFile     string
	KeyFile      string
	ClientCAFile string
}

// Register defines the flags on fs; clientCerts names the certificates
// the clients present, for -client-ca-file's help.
func (f *Flags) Register(fs *flag.FlagSet, clientCerts string) {
	fs.StringVar(&f.Listen, "listen-address", "127.0.0.1:0", "address to serve on")
	fs.StringVar(&f.CertFile, "tls-cert-file", "", "serving certificate")
	fs.StringVar(&f.KeyFile, "tls-key-file", "", "serving certificate's key")
	fs.StringVar(&f.ClientCAFile, "client-ca-file", "", "CA the clients' "+clientCerts+" are verified against")
}

// Missing reports whether a file flag is unset.
func (f *Flags) Missing() bool { return f.CertFile == "" || f.KeyFile == "" || f.ClientCAFile == "" }

// LoadTLS loads the serving certificate and key, and the CA the
// clients' certificates are verified against.
func (f *Flags) LoadTLS() (*pki.CertReloader, *x509.CertPool, error) {
	certs, err := pki.NewCertReloader(f.CertFile, f.KeyFile)
	if err != nil {
		return nil, nil, fmt.Errorf("load the serving certificate: %w", err)
	}
	roots, err := pki.LoadCertPool(f.ClientCAFile)
	if err != nil {
		return nil, nil, fmt.Errorf("load -client-ca-file: %w", err)
	}
	return certs, roots, nil
}
